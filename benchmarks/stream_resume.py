"""How long a streamed resume waits for its first batch: the loader of a 200,000-row stream
resumed at 10%, 50% and 90% of it, against a fresh start.

The shards are written here, in two formats: 16 jsonl files of text pairs, and 16
webdataset tar files of an 8-px PNG and a caption each, 12,500 rows a shard, 8
streams, a shuffle buffer of 1,000. Each resume is ``StreamBatches.set_epoch(0, step)``
then the first batch of 256 rows (one process, no workers), the rows only collected, not
decoded: the rest of a resume's start-up (the model, the checkpoint) does not depend on
where the stream stands. Median of 3.

    python -m benchmarks.stream_resume              # ~2 min on 2 cores
    python -m benchmarks.stream_resume --publish    # docs/streaming.md's table
"""

from __future__ import annotations

import io
import json
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks import standalone
from contrastive_accelerate.data.streams import StreamBatches, find_shards

ROWS, SHARDS, STREAMS, BUFFER, BATCH = 200_000, 16, 8, 1_000, 256
#: Where the resumes start, as shares of the stream's rows.
PLACES = (0.0, 0.1, 0.5, 0.9)


def write_shards(root: Path, format: str, rows: int) -> Path:
    """``rows`` rows in ``SHARDS`` shards of ``format`` (jsonl text pairs, or tar samples of
    a PNG and a caption) under ``root``."""
    from PIL import Image

    root.mkdir(parents=True)
    png = io.BytesIO()
    Image.new("L", (8, 8), 128).save(png, format="PNG")
    per_shard = rows // SHARDS
    for shard in range(SHARDS):
        first = shard * per_shard
        if format == "jsonl":
            lines = (json.dumps({"anchor": f"query {row}", "positive": f"answer {row}"})
                     for row in range(first, first + per_shard))  # fmt: skip
            (root / f"shard-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")
            continue
        with tarfile.open(root / f"shard-{shard:03d}.tar", "w") as archive:
            for row in range(first, first + per_shard):
                for extension, data in (("png", png.getvalue()), ("txt", f"a {row}".encode())):
                    member = tarfile.TarInfo(f"{row:07d}.{extension}")
                    member.size = len(data)
                    archive.addfile(member, io.BytesIO(data))
    return root


def first_batch_seconds(folder: Path, step: int) -> float:
    """Seconds from ``set_epoch(0, step)`` to the first batch of the stream in ``folder``."""
    source = find_shards(str(folder), STREAMS, BUFFER)
    batches = StreamBatches(source, lambda row, epoch, index: index, list, lambda row: None,
                            BATCH, seed=0)  # fmt: skip
    started = time.perf_counter()
    batches.set_epoch(0, step)
    next(iter(batches))
    return time.perf_counter() - started


def run(quick: bool) -> dict:
    rows, repeats = (ROWS // 20, 1) if quick else (ROWS, 3)
    results = {"rows": rows, "shards": SHARDS, "streams": STREAMS, "buffer": BUFFER,
               "batch": BATCH, "seconds": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        for format in ("jsonl", "tar"):
            folder = write_shards(Path(directory) / format, format, rows)
            results["seconds"][format] = {
                str(place): statistics.median(
                    first_batch_seconds(folder, int(place * rows) // BATCH) for _ in range(repeats)
                )
                for place in PLACES
            }
    return results


def table_lines(results: dict) -> list[str]:
    head = " | ".join(f"resumed at {float(place):.0%}" for place in PLACES[1:])
    lines = [f"| shards | a fresh start | {head} |", "|---" * (len(PLACES) + 1) + "|"]
    for format, seconds in results["seconds"].items():
        cells = " | ".join(f"{seconds[str(place)]:.2f} s" for place in PLACES)
        lines.append(f"| {format} | {cells} |")
    lines += [
        "",
        f"The first batch of {results['batch']} rows after `set_epoch(0, step)`: "
        f"{results['rows']:,} rows in {results['shards']} shards, {results['streams']} "
        f"streams, a shuffle buffer of {results['buffer']}; one process, no workers, median "
        "of 3 (`python -m benchmarks.stream_resume`).",
    ]
    return lines


if __name__ == "__main__":
    standalone.main("stream_resume", __doc__.splitlines()[0], run, table_lines,
                    page="streaming.md")  # fmt: skip
