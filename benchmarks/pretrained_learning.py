"""Does self-supervised training adapt a timm tower to one's own images? SimCLR and DINO
on a timm ResNet (``--timm-model``), from the offline digits' table and from webdataset
tar shards of the same training rows (a stream, evaluated on the held-out digits through
``--eval-dataset``): the kNN top-1 and the linear probe of the tower before training
(the run's step 0) and after, on the same 360 held-out digits.

The tower is timm's ``resnet10t`` with random weights, its input the digits upsampled
to 32 px (its stem divides by 4): no pretrained tower of the digits' size exists, so
it starts from scratch, loaded as a pretrained one is (timm's hub layout, safetensors).
(A tiny timm ViT of the digits' own size, 8 px in patches of 2, was tried first: its
random features give 19% and SimCLR took it to 44% in 30 epochs, DINO to 22%.) Each
run is the README's command with the tower and the method, one process, in a fresh
process.

    python -m benchmarks.pretrained_learning            # 2 methods x 2 sources
    python -m benchmarks.pretrained_learning --publish  # refresh the published figures
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path

from benchmarks import standalone

ARCHITECTURE, TOWER, IMAGE_SIZE = "resnet10t", {}, 32
EPOCHS = 10
#: Each method's command line besides the tower and the data (its digits recipe's
#: defaults otherwise; DINO's two local crops at half the size).
METHODS = {
    "simclr": ["--method", "simclr", "--epochs", str(EPOCHS)],
    "dino": [
        "--method",
        "dino",
        "--epochs",
        str(EPOCHS),
        "--local-crops",
        "2",
        "--local-crop-size",
        str(IMAGE_SIZE // 2),
    ],  # fmt: skip
}
SOURCES = ("table", "stream")
#: The table's epochs of ceil(1437 / 64) batches, as steps of the stream.
STREAM_STEPS = EPOCHS * 23
SHARD_ROWS = 256


def write_tower(root: Path) -> Path:
    """The tower, random weights, in timm's hub layout (``models.timm_tower``'s own
    export writes it)."""
    import timm
    import torch

    from models.timm_tower import TimmTower, save_timm_tower

    torch.manual_seed(0)
    encoder = timm.create_model(ARCHITECTURE, pretrained=False, num_classes=0, **TOWER)
    save_timm_tower(TimmTower(encoder, ARCHITECTURE, TOWER), str(root))
    return root


def write_stream(root: Path) -> tuple[Path, Path]:
    """The digits' training rows (the trainer's own split) as tar shards of
    ``SHARD_ROWS`` (``KEY.png``, ``KEY.cls``), and the whole split (training and
    held-out rows) as a ``save_to_disk`` folder for ``--eval-dataset``."""
    import datasets

    from contrastive_accelerate.data.sources import load_image_dataset

    digits = load_image_dataset(None)
    shards = root / "shards"
    shards.mkdir(parents=True)
    train = digits.train
    for start in range(0, len(train), SHARD_ROWS):
        with tarfile.open(shards / f"digits-{start // SHARD_ROWS:05d}.tar", "w") as archive:
            for row in range(start, min(start + SHARD_ROWS, len(train))):
                record = train[row]
                members = {"png": record[digits.image_column]["bytes"],
                           "cls": str(record[digits.label_column]).encode()}  # fmt: skip
                for extension, data in members.items():
                    member = tarfile.TarInfo(f"{row:06d}.{extension}")
                    member.size = len(data)
                    archive.addfile(member, io.BytesIO(data))
    held = root / "held-out"
    datasets.DatasetDict({"train": train, "test": digits.evaluation}).save_to_disk(str(held))
    return shards, held


def one_run(method: str, source: str, tower: Path, stream: tuple[Path, Path], quick: bool):
    """One run's figures: kNN and linear probe before (step 0) and after, and its time."""
    data = [] if source == "table" else [
        "--dataset", str(stream[0]), "--streaming", "--image-column", "png",
        "--eval-dataset", str(stream[1]), "--max-steps", "50" if quick else str(STREAM_STEPS),
    ]  # fmt: skip
    arguments = [*METHODS[method], "--timm-model", str(tower), "--image-size", str(IMAGE_SIZE),
                 *data]  # fmt: skip
    if quick and source == "table":
        arguments += ["--max-steps", "50"]
    result, seconds, records = standalone.readme_run(arguments)
    if result.returncode != 0:
        return {"method": method, "source": source, "error": result.stderr[-800:]}
    row = {"method": method, "source": source, "seconds": round(seconds, 1)}
    for record in records:  # the kNN at step 0 (the tower before training), then at the end
        if "knn_top1" in record:
            row.setdefault("knn_top1_before", record["knn_top1"])
        row |= {key: record[key] for key in ("knn_top1", "linear_probe_top1",
                                               "raw_pixels_knn_top1") if key in record}  # fmt: skip
    return row


def run(quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        tower, stream = write_tower(root / "tower"), write_stream(root / "stream")
        rows = [one_run(method, source, tower, stream, quick)
                for method in METHODS for source in SOURCES]  # fmt: skip
    return {"tower": ARCHITECTURE, "image_size": IMAGE_SIZE, "methods": METHODS, "rows": rows}


def table_lines(results: dict) -> list[str]:
    lines = [
        "| method | source | kNN before | kNN after | gain | linear probe after | time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['method']} | {row['source']} | failed: "
                         f"{row['error'].strip().splitlines()[-1]} | | | | |")  # fmt: skip
            continue
        before, after = row.get("knn_top1_before"), row.get("knn_top1")
        gain = f"{100 * (after - before):+.1f}" if None not in (before, after) else "n/a"
        probe = row.get("linear_probe_top1")
        lines.append(
            f"| {row['method']} | {row['source']} | {before:.1%} | {after:.1%} | {gain} "
            f"| {f'{probe:.1%}' if probe is not None else 'n/a'} | {row['seconds']:.0f} |"
        )
    return lines


if __name__ == "__main__":
    standalone.main("pretrained_learning", __doc__.split("\n")[0], run, table_lines)
