"""Distillation on the digits: a smaller student from a teacher that the README's first
command trained.

The teacher is the README's first command as it stands (SimCLR, ResNet-18, seed 0),
its ``final/`` kept in ``--teacher-dir`` and reused while there. Each student is the
same command with ``--method distill --distill-teacher <final/> --model STUDENT --seed
S`` at the default budget: its kNN top-1 and linear probe on the 360 held-out digits,
beside its random-init encoder's kNN (the run's step 0) and the teacher's figures.
``--jobs`` runs side by side on an equal share of the cores; finished runs are kept in
``--saved-runs`` and reused while their recipe is today's.

    python -m benchmarks.distill --jobs 2             # the teacher, then 2 x 3 students
    python -m benchmarks.distill --jobs 2 --students vit_micro  # one student's rows
    python -m benchmarks.distill --quick              # 20 steps each
    python -m benchmarks.distill --jobs 2 --publish   # refresh docs/methods.md and results.json
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from pathlib import Path

from benchmarks import standalone
from benchmarks.methods import knn_run
from trainer import TrainConfig

#: The students, smaller than the teacher's ResNet-18 (11.2M parameters in its encoder):
#: the mlp (0.1M), whose random features are already near raw pixels on the digits, and
#: vit_micro (0.2M), whose are not. ViT-Tiny (5.4M) took 179 s for 20 steps on 2 cores
#: here, days for the default budget: ``--students vit_tiny`` where a GPU is at hand.
STUDENTS = ("mlp", "vit_micro")


def teacher(directory: Path, quick: bool, threads: int) -> dict:
    """The README's first command into ``directory`` (kept), its figures; a teacher
    already there is reused."""
    extra = ["--max-steps", "20"] if quick else []
    figures = directory / "figures.json"
    if figures.exists() and (directory / "final" / "config.json").exists():
        return standalone.stored(figures)
    directory.parent.mkdir(parents=True, exist_ok=True)
    result, seconds, records = standalone.readme_run(extra, threads, kept=directory)
    if result.returncode != 0:
        raise SystemExit(f"the teacher's run failed: {result.stderr[-500:]}")
    row = {"seconds": seconds}
    for record in records:
        for key in ("knn_top1", "linear_probe_top1", "raw_pixels_knn_top1"):
            if key in record:
                row[key] = record[key]
    standalone.merge(figures, "teacher", row)
    return standalone.stored(figures)


def student(job: tuple[str, int], final: Path, quick: bool, threads: int) -> dict:
    model, seed = job
    extra = ["--distill-teacher", str(final), "--model", model]
    extra += ["--max-steps", "20"] if quick else []
    return {**knn_run("distill", extra, seed, threads), "student": model, "threads": threads}


def run(
    quick: bool,
    seeds: int,
    jobs: int,
    saved: Path | None,
    directory: Path,
    students: tuple[str, ...] = STUDENTS,
) -> dict:
    threads = max(1, (os.cpu_count() or 1) // jobs)
    trained = teacher(directory, quick, (os.cpu_count() or 1))["teacher"]
    final = directory / "final"
    recipe = {model: standalone.recipe_digest(
        TrainConfig(method="distill", distill_teacher=str(final), model=model), quick,
        trained.get("knn_top1"),
    ) for model in students}  # fmt: skip
    rows = standalone.resumable_runs(
        [(model, seed) for model in students for seed in range(seeds)],
        partial(student, final=final, quick=quick, threads=threads),
        job_of=lambda row: (row["student"], row["seed"]),
        recipe_of=lambda job: recipe[job[0]],
        saved=saved,
        parallel=jobs,
    )
    return {"teacher": trained, "students": rows, "quick": quick, "jobs": jobs,
            "models": list(students)}  # fmt: skip


def with_earlier_students(results: dict, earlier: dict | None) -> dict:
    """A run of some students (``--students``) completed by ``earlier``'s rows of the
    others, when both had the same teacher (its kNN and probe figures equal)."""
    figures = ("knn_top1", "linear_probe_top1")
    if not earlier or any(earlier["teacher"].get(f) != results["teacher"].get(f) for f in figures):
        return results
    kept = [model for model in earlier["models"] if model not in results["models"]]
    rows = [row for row in earlier["students"] if row["student"] in kept]
    return {**results, "students": rows + results["students"],
            "models": kept + results["models"]}  # fmt: skip


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.1%} [{min(values):.1%}, {max(values):.1%}]"


def table_lines(results: dict) -> list[str]:
    trained = results["teacher"]
    lines = [
        "| student | kNN top-1 (mean [min, max]) | gain over its random init (min) "
        "| vs the teacher's kNN (least) | linear probe | run (s, median) |",
        "|---|---|---|---|---|---|",
    ]
    for model in results["models"]:
        rows = [row for row in results["students"] if row["student"] == model
                and "knn_top1" in row]  # fmt: skip
        knn = [row["knn_top1"] for row in rows]
        gains = [row["knn_top1"] - row["knn_top1_init"] for row in rows if "knn_top1_init" in row]
        above = [value - trained["knn_top1"] for value in knn]
        lines.append(
            f"| `{model}` | {_spread(knn)} | {100 * min(gains):+.1f} "
            f"| {100 * min(above):+.1f} points | "
            f"{_spread([row['linear_probe_top1'] for row in rows])} "
            f"| {statistics.median(row['seconds'] for row in rows):.0f} |"
            if rows
            else f"| `{model}` | failed | | | | |"
        )
    seeds = sorted({row["seed"] for row in results["students"]})
    lines += [
        "",
        f"Teacher: the README's first command (SimCLR, ResNet-18, seed 0): kNN top-1 "
        f"{trained['knn_top1']:.1%}, linear probe {trained['linear_probe_top1']:.1%} "
        f"({trained['seconds']:.0f} s); raw pixels {trained['raw_pixels_knn_top1']:.1%}. "
        f"Students: seeds {', '.join(map(str, seeds))}, {results['jobs']} at a time"
        f"{', 20 steps each (--quick)' if results['quick'] else ', the default budget'}.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 training steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="student seeds 0..N-1")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side")
    parser.add_argument(
        "--teacher-dir", default="benchmarks/results/distill_teacher",
        help="the teacher's run, kept and reused while its final/ is there",
    )  # fmt: skip
    parser.add_argument("--saved-runs", default="benchmarks/results/distill_runs.jsonl")
    parser.add_argument("--students", default=",".join(STUDENTS), help="comma-separated towers")
    standalone.add_output_arguments(parser, "distill")
    args = parser.parse_args()
    path = standalone.results_path(parser, args, "distill")
    directory = Path(args.teacher_dir + ("_quick" if args.quick else ""))
    saved = None if args.quick else Path(args.saved_runs)
    students = tuple(args.students.split(","))
    results = run(args.quick, args.seeds, args.jobs, saved, directory, students)
    results = with_earlier_students(results, standalone.stored(path).get("distill"))
    standalone.merge(path, "distill", results)
    lines = table_lines(results)
    print("\n".join(lines))
    if args.publish:
        standalone.write_docs("distill", lines, "methods.md")


if __name__ == "__main__":
    main()
