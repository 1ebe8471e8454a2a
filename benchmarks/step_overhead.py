"""The trainer's step against a hand-written Accelerate loop with the same model, loss and
optimizer, from a tiny tower to ResNet-18: what the trainer's fixed cost per step (the
per-sample keys, the step's checks, logging) adds where a step is short.

Both loops train SimCLR on the offline digits with SGD and NT-Xent, one process, the
loaders without workers (``benchmarks.throughput.hand_written_loop`` is the peer: a
shuffled DataLoader, augmentations from the global RNG, plain dropout). The runs of one
size alternate, trainer first then the loop, ``repeats`` times; each reports samples/s
from its first to its last step (the first step's warm-up included in both), and the
medians are compared.

    python -m benchmarks.step_overhead                 # ~5 min on 2 cores
    python -m benchmarks.step_overhead --publish       # docs/benchmarks.md's table
"""

from __future__ import annotations

from benchmarks import standalone
from benchmarks.throughput import trainer_throughput

#: The towers compared, each at an image size it takes: (model, image size).
SIZES = (("mlp", 8), ("vit_micro", 8), ("resnet18", 8), ("resnet18", 16))


def compare(model: str, image_size: int, steps: int, repeats: int, batch_size: int = 64) -> dict:
    """``trainer_throughput`` without loader workers, and each loop's milliseconds a step."""
    row = trainer_throughput(steps, batch_size, image_size, repeats, model, num_workers=0)
    speeds = row["samples_per_s"]
    return {**row, "ms_per_step": {name: 1e3 * batch_size / speed
                                   for name, speed in speeds.items()}}  # fmt: skip


def run(quick: bool) -> dict:
    steps, repeats = (6, 1) if quick else (30, 3)
    return {"rows": [compare(model, size, steps, repeats) for model, size in SIZES]}


def table_lines(results: dict) -> list[str]:
    lines = [
        "| tower | image size | trainer ms/step | hand-written ms/step | trainer / hand-written |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        ms = row["ms_per_step"]
        lines.append(
            f"| {row['model']} | {row['image_size']} px | {ms['trainer']:.1f} | "
            f"{ms['hand_written']:.1f} | {ms['trainer'] / ms['hand_written']:.2f}x |"
        )
    first = results["rows"][0]
    lines += [
        "",
        f"SimCLR, SGD, NT-Xent, global batch {first['batch_size']}, {first['steps']} steps, "
        "1 process, no loader workers; medians of alternated runs "
        "(`python -m benchmarks.step_overhead`).",
    ]
    return lines


if __name__ == "__main__":
    standalone.main("step_overhead", __doc__.splitlines()[0], run, table_lines,
                    page="benchmarks.md")  # fmt: skip
