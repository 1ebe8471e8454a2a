"""The default run's result over seeds and kernel paths: is it a property of the recipe?

Runs the README's first command (one process, the offline digits) for each seed and
each ``OMP_NUM_THREADS`` (1 and 2 change the float32 reduction order the way another
CPU does), in a fresh process each, and reports the kNN top-1 accuracy of the trained
encoder (and of the linear probe, when the run prints one) with its mean, minimum and
maximum, next to kNN on raw pixels and on the random-init encoder over the same
held-out images. ``--quick``: 2 seeds, 1 kernel path, 40 steps (a smoke test). Finished
runs are kept in ``--saved-runs``: run again after an interruption, it trains only the rest.

    python -m benchmarks.quality            # 5 seeds x 2 kernel paths: about an hour on 2 cores
    python -m benchmarks.quality --jobs 2   # two runs side by side (the kernel path unchanged)
    python -m benchmarks.quality --jobs 2 --publish   # refresh docs/benchmarks.md's figures
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
from pathlib import Path

from benchmarks import standalone
from contrastive_accelerate.config import parse_args
from trainer import TrainConfig

SEEDS = (0, 1, 2, 3, 4)
THREADS = (1, 2)


def one_run(seed: int, threads: int, extra: list[str]) -> dict:
    """The README's first command with ``--seed seed`` under ``OMP_NUM_THREADS=threads``."""
    result, seconds, records = standalone.readme_run(["--seed", str(seed), *extra], threads)
    if result.returncode != 0:
        return {"seed": seed, "threads": threads, "error": result.stderr[-500:]}
    row = {"seed": seed, "threads": threads, "seconds": seconds, "summary": _summary(result)}
    for record in records:
        for key in ("knn_top1", "linear_probe_top1", "raw_pixels_knn_top1",
                    "raw_pixels_linear_probe_top1"):  # fmt: skip
            if key in record:
                row.setdefault(f"{key}_first", record[key])
                row[key] = record[key]
    row["knn_top1_init"] = row.pop("knn_top1_first", None)
    return row


def _summary(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stdout.splitlines() if re.match(r"(kNN|linear)", line)]
    return " | ".join(lines)


def recipe(extra: list[str]) -> str:
    """A digest of what the runs train with (the default run's resolved options and the
    extra arguments): a saved run counts only while its recipe is today's."""
    return standalone.recipe_digest(parse_args(TrainConfig, extra), extra)


def run(
    quick: bool, extra: list[str] | None = None, jobs: int = 1, saved: Path | None = None
) -> dict:
    extra = list(extra or [])
    seeds, threads = (SEEDS[:2], THREADS[:1]) if quick else (SEEDS, THREADS)
    if quick:
        extra += ["--max-steps", "40"]
    digest = recipe(extra)
    rows = standalone.resumable_runs(
        [(seed, count) for seed in seeds for count in threads],
        lambda job: one_run(*job, extra),
        job_of=lambda row: (row["seed"], row["threads"]),
        recipe_of=lambda job: digest,
        saved=saved,
        parallel=jobs,
    )
    return {"extra_args": extra, "jobs": jobs, "rows": rows}


def _spread(values: list[float]) -> str:
    return (
        f"mean {statistics.mean(values):.1%}, min {min(values):.1%}, max {max(values):.1%}"
        if values
        else "n/a"
    )


def table_lines(results: dict) -> list[str]:
    rows = [row for row in results["rows"] if "error" not in row]
    failed = len(results["rows"]) - len(rows)
    seeds = sorted({row["seed"] for row in rows})
    threads = sorted({row["threads"] for row in rows})
    args = " ".join(results["extra_args"]) or "(none)"
    lines = [
        f"The default run over seeds {', '.join(map(str, seeds))} and OMP_NUM_THREADS "
        f"{' and '.join(map(str, threads))} ({len(rows)} runs, extra arguments: {args}"
        f"{f'; {failed} failed' if failed else ''}); top-1 on the 360 held-out digits",
        "",
        "| evaluation | mean | min | max |",
        "|---|---|---|---|",
    ]
    for label, key in (
        ("kNN, raw pixels", "raw_pixels_knn_top1"),
        ("kNN, random-init encoder", "knn_top1_init"),
        ("kNN, trained encoder", "knn_top1"),
        ("linear probe, raw pixels", "raw_pixels_linear_probe_top1"),
        ("linear probe, trained encoder", "linear_probe_top1"),
    ):
        values = [row[key] for row in rows if row.get(key) is not None]
        if values:
            lines.append(
                f"| {label} | {statistics.mean(values):.1%} | {min(values):.1%} "
                f"| {max(values):.1%} |"
            )
    if rows:
        seconds = [row["seconds"] for row in rows]
        lines += ["", f"Wall time per run: median {statistics.median(seconds):.0f} s, "
                  f"max {max(seconds):.0f} s ({results.get('jobs', 1)} at a time)."]  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, 1 kernel path, 40 steps")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side")
    parser.add_argument(
        "--saved-runs",
        default="benchmarks/results/quality_runs.jsonl",
        help="finished runs, appended as they end; those of today's recipe are reused",
    )
    standalone.add_output_arguments(parser, "quality")
    parser.add_argument("trainer_args", nargs="*", help="after --: extra trainer.py arguments")
    args = parser.parse_args()
    if args.publish and args.trainer_args:
        parser.error("--publish refreshes the default recipe's figures: no trainer arguments")
    path = standalone.results_path(parser, args, "quality")
    saved = None if args.quick else Path(args.saved_runs)
    results = run(args.quick, args.trainer_args, args.jobs, saved)
    standalone.merge(path, "quality", results)
    lines = table_lines(results)
    print("\n".join(lines))
    if args.publish:
        standalone.write_docs("quality", lines, "benchmarks.md")


if __name__ == "__main__":
    main()
