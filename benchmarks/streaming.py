"""Loader throughput: the streamed loader against the map-style one and webdataset's own
``WebLoader``, on the same tar shards, with 0 and 2 workers, one process.

The shards are written here: 16 webdataset tar files of 256 samples, each a 32 px RGB
PNG and a caption. Every loader does the same per-sample work, image-text's
``ImageCaptions.item`` (decode, SimCLR's augmentation drawn from the sample's id,
tokenize) and the same ``collate``, into global batches of 256; only reading and
scheduling differ:

- ``streamed``: ``--streaming``'s ``StreamBatches``, 8 streams, a shuffle buffer of 1000;
  its workers each read every stream and decode their own steps' rows;
- ``map-style``: the same samples as a ``datasets.Dataset`` (undecoded PNG bytes) through
  ``GlobalBatchSampler``, today's loader;
- ``webdataset``: ``WebDataset(shards).shuffle(1000)`` through ``WebLoader`` (its workers
  split the shards: the per-rank practice, which the streamed loader's order does not
  depend on).

samples/s from the end of the first batch (the workers' start-up left out) to the last,
median of 3 rounds.
"""

from __future__ import annotations

import io
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import standalone

IMAGE_SIZE, SHARDS, PER_SHARD, BATCH = 32, 16, 256, 256
WORDS = "red green blue small large cat dog bird fish tree river stone cloud".split()


def write_shards(root: Path, shards: int, per_shard: int) -> list[str]:
    from PIL import Image

    generator = np.random.default_rng(0)
    paths = []
    for shard in range(shards):
        path = root / f"shard-{shard:05d}.tar"
        with tarfile.open(path, "w") as archive:
            for row in range(per_shard):
                key = f"{shard * per_shard + row:08d}"
                pixels = generator.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
                png = io.BytesIO()
                Image.fromarray(pixels).save(png, format="PNG")
                caption = " ".join(generator.choice(WORDS, size=6))
                for extension, data in (("png", png.getvalue()), ("txt", caption.encode())):
                    member = tarfile.TarInfo(f"{key}.{extension}")
                    member.size = len(data)
                    archive.addfile(member, io.BytesIO(data))
        paths.append(str(path))
    return paths


def captions_dataset(table=None):
    """Image-text's per-sample work (``ImageCaptions``) over ``table`` (None: a stream's rows)."""
    from contrastive_accelerate.data.pairs import ImageCaptions
    from models.text import scratch_text_encoder

    _, tokenizer = scratch_text_encoder(WORDS, 16, torch.float32)
    return ImageCaptions(table, "png", "txt", tokenizer, 16, IMAGE_SIZE, seed=0)


class _WebDatasetItems:
    """A webdataset sample (``{"png": bytes, "txt": bytes}``) through ``ImageCaptions.item``."""

    def __init__(self, captions) -> None:
        self.captions, self.count = captions, 0

    def __call__(self, sample: dict):
        row = {"png": {"bytes": sample["png"], "path": sample["__key__"]},
               "txt": sample["txt"].decode()}  # fmt: skip
        self.count += 1
        return self.captions.item(row, 0, self.count)


def _loader(kind: str, paths: list[str], workers: int, captions, batch: int):
    from torch.utils.data import DataLoader

    from contrastive_accelerate.data import GlobalBatchSampler, StreamBatches
    from contrastive_accelerate.data.loader import as_built
    from contrastive_accelerate.data.streams import find_shards

    if kind == "streamed":
        source = find_shards(str(Path(paths[0]).parent / "*.tar"), None, 1000)
        stream = StreamBatches(source, captions.item, captions.collate, captions.problem,
                               batch, seed=0)  # fmt: skip
        return DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=as_built)
    if kind == "map-style":
        sampler = GlobalBatchSampler(len(captions.dataset), batch, 0, seed=0)
        return DataLoader(captions, batch_sampler=sampler, collate_fn=captions.collate,
                          num_workers=workers)  # fmt: skip
    import webdataset

    dataset = (
        webdataset.WebDataset(paths, shardshuffle=False, empty_check=False)
        .shuffle(1000)
        .map(_WebDatasetItems(captions))
        .batched(batch, collation_fn=captions.collate)
    )
    return webdataset.WebLoader(dataset, batch_size=None, num_workers=workers)


def _table(paths: list[str]):
    """The shards as a ``datasets.Dataset`` of undecoded PNG bytes and captions."""
    import datasets

    rows = {"png": [], "txt": []}
    for path in paths:
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                data = archive.extractfile(member).read()
                if member.name.endswith(".png"):
                    rows["png"].append({"bytes": data, "path": member.name})
                else:
                    rows["txt"].append(data.decode())
    return datasets.Dataset.from_dict(rows).cast_column("png", datasets.Image(decode=False))


def samples_per_s(loader, batches: int) -> float:
    iterator = iter(loader)
    next(iterator)  # the workers' start-up is not the loader's rate
    started, samples = time.perf_counter(), 0
    for _ in range(batches - 1):
        samples += len(next(iterator).images)
    return samples / (time.perf_counter() - started)


def run(quick: bool) -> dict:
    shards, per_shard, rounds, batch = (4, 16, 1, 16) if quick else (SHARDS, PER_SHARD, 3, BATCH)
    batches = shards * per_shard // batch
    rows = []
    with tempfile.TemporaryDirectory() as root:
        paths = write_shards(Path(root), shards, per_shard)
        streamed = captions_dataset()
        table = captions_dataset(_table(paths))
        for workers in (0,) if quick else (0, 2):  # (workers in a test's process outlive it)
            for kind in ("streamed", "map-style", "webdataset"):
                captions = table if kind == "map-style" else streamed
                rates = [samples_per_s(_loader(kind, paths, workers, captions, batch), batches)
                         for _ in range(rounds)]  # fmt: skip
                rate = statistics.median(rates)
                rows.append({"loader": kind, "workers": workers, "samples_per_s": rate,
                             "rounds": rates})  # fmt: skip
                print(f"streaming: {rows[-1]}", flush=True)
    return {"shards": shards, "per_shard": per_shard, "batch": batch, "rows": rows}


def table_lines(results: dict) -> list[str]:
    lines = [
        f"{results['shards']} tar shards x {results['per_shard']} samples (32 px PNG + "
        f"caption), batches of {results['batch']}, 1 process; samples/s, median of rounds",
        "",
        "| workers | streamed | map-style | webdataset WebLoader |",
        "|---|---|---|---|",
    ]
    for workers in dict.fromkeys(row["workers"] for row in results["rows"]):
        rate = {row["loader"]: row["samples_per_s"] for row in results["rows"]
                if row["workers"] == workers}  # fmt: skip
        lines.append(f"| {workers} | {rate['streamed']:.0f} | {rate['map-style']:.0f} | "
                     f"{rate['webdataset']:.0f} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    standalone.main("streaming", __doc__.split("\n")[0], run, table_lines)
