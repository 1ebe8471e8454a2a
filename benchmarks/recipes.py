"""The search for the default run's recipe: every recipe tried, its kNN and probe over
seeds, and its time.

Each recipe is the README's first command with its arguments (SimCLR, ResNet-18, the
offline digits, 45 epochs unless it says otherwise), run for each seed in a fresh
process on one thread, ``--jobs`` side by side, so that their times compare. A recipe
names every option it sets, so its row means the same after the defaults change; the
row ``default`` is the command as written. Recipes whose resolved options are equal
share their runs. The search goes in stages: a recipe is run on seed 0 first, and on
seeds 1 and 2 when its seed 0 is the best so far (``--seeds``).

    python -m benchmarks.recipes --jobs 2 --recipes old-default affine --seeds 0 1 2
    python -m benchmarks.recipes --publish     # the table and plot of every saved run, and
                                               # the runs in benchmarks/results.json

The table goes to ``docs/benchmarks.md``, the plot (kNN against time per recipe) to
``docs/recipes.svg``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks import quality, standalone
from contrastive_accelerate.config import parse_args
from trainer import TrainConfig

#: The digits' recipes tried, in the order tried: name -> (what it changes, arguments).
#: ``lr-0.1-t-0.2``, ``affine-t-0.1`` and ``affine-b-128`` were screened on seed 0 before
#: this module existed (docs/benchmarks.md gives their figures); the rest ran here.
RECIPES: dict[str, tuple[str, str]] = {
    "old-default": (
        "the default before the search: SimCLR's augmentation, crops from 0.5, lr 0.03, "
        "temperature 0.5",
        "--augmentation simclr --crop-min-scale 0.5 --lr 0.03 --temperature 0.5",
    ),
    "lr-0.1-t-0.2": (
        "SimCLR's augmentation, lr 0.1 and temperature 0.2 (MoCo's digits recipe)",
        "--augmentation simclr --crop-min-scale 0.5 --lr 0.1 --temperature 0.2",
    ),
    "affine": (
        "the affine augmentation, crops from 0.7, lr 0.1, temperature 0.2",
        "--augmentation affine --crop-min-scale 0.7 --lr 0.1 --temperature 0.2",
    ),
    "affine-t-0.1": (
        "as affine, temperature 0.1",
        "--augmentation affine --crop-min-scale 0.7 --lr 0.1 --temperature 0.1",
    ),
    "affine-b-128": (
        "as affine, global batch 128 at lr 0.2",
        "--augmentation affine --crop-min-scale 0.7 --lr 0.2 --temperature 0.2 --batch-size 128",
    ),
    "old-default-75-epochs": (
        "the old default with 75 epochs (MoCo's and BYOL's digits budget)",
        "--augmentation simclr --crop-min-scale 0.5 --lr 0.03 --temperature 0.5 --epochs 75",
    ),
    "affine-75-epochs": (
        "as affine, 75 epochs",
        "--augmentation affine --crop-min-scale 0.7 --lr 0.1 --temperature 0.2 --epochs 75",
    ),
    "default": ("the README's first command as written", ""),
}
SEEDS = (0, 1, 2)
THREADS = 1


def recipe_key(arguments: list[str]) -> str:
    """What a recipe's runs are stored under: its resolved options' digest."""
    return standalone.recipe_digest(parse_args(TrainConfig, arguments))


def one_run(key: str, seed: int, arguments: list[str]) -> dict:
    """The README's command with ``arguments`` and ``--seed seed`` (``benchmarks.quality``'s
    run, on ``THREADS``), stored under the recipe's ``key``."""
    return {"key": key, **quality.one_run(seed, THREADS, arguments)}


def run(names: list[str], seeds: list[int], jobs: int, saved: Path) -> list[dict]:
    """Every saved run, after running each of ``names`` on each of ``seeds``."""
    keys = {name: recipe_key(RECIPES[name][1].split()) for name in RECIPES}
    arguments = {keys[name]: RECIPES[name][1].split() for name in names}
    wanted = [(keys[name], seed) for name in names for seed in seeds]
    standalone.resumable_runs(
        list(dict.fromkeys(wanted)),
        lambda job: one_run(*job, arguments[job[0]]),
        job_of=lambda row: (row["key"], row["seed"]),
        recipe_of=lambda job: job[0],
        saved=saved,
        parallel=jobs,
    )
    return standalone.saved_rows(saved)


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.1%} [{min(values):.1%}, {max(values):.1%}]"


def summaries(rows: list[dict]) -> list[dict]:
    """One entry per recipe with runs: its figures over its seeds."""
    entries = []
    for name, (change, arguments) in RECIPES.items():
        key = recipe_key(arguments.split())
        runs = sorted((row for row in rows if row["key"] == key), key=lambda row: row["seed"])
        if runs:
            entries.append({"name": name, "change": change, "runs": runs})
    return entries


def table_lines(rows: list[dict]) -> list[str]:
    entries = summaries(rows)
    raw = {row["raw_pixels_knn_top1"] for entry in entries for row in entry["runs"]}
    lines = [
        "| recipe | what it changes | seeds | kNN top-1 (mean [min, max]) | every seed above "
        "raw pixels | linear probe | random init | run (s, median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in entries:
        runs = entry["runs"]
        knn = [row["knn_top1"] for row in runs]
        above = all(row["knn_top1"] > row["raw_pixels_knn_top1"] for row in runs)
        lines.append(
            f"| `{entry['name']}` | {entry['change']} | "
            f"{', '.join(str(row['seed']) for row in runs)} | {_spread(knn)} | "
            f"{'yes' if above else 'no'} | "
            f"{_spread([row['linear_probe_top1'] for row in runs])} | "
            f"{_spread([row['knn_top1_init'] for row in runs])} | "
            f"{statistics.median(row['seconds'] for row in runs):.0f} |"
        )
    lines += ["", f"kNN top-1 of raw pixels on the same 360 held-out digits: "
              f"{', '.join(f'{value:.1%}' for value in sorted(raw))}. Each run on "
              f"{THREADS} thread, two side by side on this 2-core machine."]  # fmt: skip
    return lines


def plot(rows: list[dict]) -> str:
    """An SVG of each recipe's mean kNN top-1 against its median run time, raw pixels'
    kNN as a line."""
    entries = summaries(rows)
    width, height, margin = 640, 360, 60
    names: dict[str, list[str]] = {}  # recipes that share their runs share a point
    for entry in entries:
        names.setdefault(entry["runs"][0]["key"], []).append(entry["name"])
    points = [(statistics.median(row["seconds"] for row in entry["runs"]),
               statistics.mean(row["knn_top1"] for row in entry["runs"]),
               " = ".join(names.pop(entry["runs"][0]["key"])))
              for entry in entries if entry["runs"][0]["key"] in names]  # fmt: skip
    raw = statistics.mean(row["raw_pixels_knn_top1"] for entry in entries for row in entry["runs"])
    seconds = [point[0] for point in points]
    accuracy = [point[1] for point in points] + [raw]
    x_range = (min(seconds) * 0.9, max(seconds) * 1.1)
    y_range = (min(accuracy) - 0.005, max(accuracy) + 0.005)

    def x(value: float) -> float:
        return margin + (value - x_range[0]) / (x_range[1] - x_range[0]) * (width - 2 * margin)

    def y(value: float) -> float:
        return (
            height
            - margin
            - (value - y_range[0]) / (y_range[1] - y_range[0]) * (height - 2 * margin)
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" '
        f'y2="{height - margin}" stroke="black"/>',
        f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">'
        "run time (s, median over seeds)</text>",
        f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" '
        'text-anchor="middle">kNN top-1 (mean over seeds)</text>',
        f'<line x1="{margin}" y1="{y(raw):.1f}" x2="{width - margin}" y2="{y(raw):.1f}" '
        'stroke="grey" stroke-dasharray="4"/>',
        f'<text x="{width - margin}" y="{y(raw) - 4:.1f}" text-anchor="end" fill="grey">'
        f"raw pixels {raw:.1%}</text>",
    ]
    for tick in (y_range[0], (y_range[0] + y_range[1]) / 2, y_range[1]):
        parts.append(f'<text x="{margin - 4}" y="{y(tick) + 4:.1f}" text-anchor="end">'
                     f"{tick:.1%}</text>")  # fmt: skip
    for tick in (x_range[0], (x_range[0] + x_range[1]) / 2, x_range[1]):
        parts.append(f'<text x="{x(tick):.1f}" y="{height - margin + 16}" '
                     f'text-anchor="middle">{tick:.0f}</text>')  # fmt: skip
    for seconds_value, accuracy_value, name in points:
        parts.append(f'<circle cx="{x(seconds_value):.1f}" cy="{y(accuracy_value):.1f}" r="4"/>')
        parts.append(f'<text x="{x(seconds_value) + 6:.1f}" y="{y(accuracy_value) - 6:.1f}">'
                     f"{name}</text>")  # fmt: skip
    return "\n".join([*parts, "</svg>", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="*", default=[], choices=RECIPES, metavar="NAME")
    parser.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side")
    parser.add_argument(
        "--saved-runs",
        default="benchmarks/results/recipes_runs.jsonl",
        help="finished runs, appended as they end; the table is of every saved run",
    )
    parser.add_argument("--publish", action="store_true", help="refresh the docs' table and plot")
    args = parser.parse_args()
    rows = run(args.recipes, args.seeds, args.jobs, Path(args.saved_runs))
    lines = table_lines(rows)
    print("\n".join(lines))
    if args.publish:
        standalone.merge(standalone.PUBLISHED, "recipes", {"threads": THREADS, "rows": rows})
        standalone.write_docs("recipes", lines, "benchmarks.md")
        (standalone.DOCS / "recipes.svg").write_text(plot(rows))


if __name__ == "__main__":
    main()
