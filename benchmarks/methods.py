"""The methods side by side: step time against SimCLR, the EMA update's share, the
multi-crop loader against the model's consumption, and kNN on the digits per method.

Step times are one process, ResNet-18 on the digits at the same global batch (DINOv2:
its ``vit_micro``, ``METHOD_OPTIONS``), the methods interleaved round by round in one
process (median over rounds; each step is
``cached_backward`` through the method's own embed and loss, the optimizer, and
``after_step``). The EMA update is timed alone on the same model. The loader rate is
DINO's multi-crop dataset (2 global crops of 8 px, 6 local of 4 px) through a
``DataLoader`` with 0 and 2 workers. kNN runs the README's first command with
``--method NAME --seed S`` for each method and seed, at the default run's budget,
``--jobs`` at a time on an equal share of the cores each; beside DINO and BYOL, lightly's
own implementation of the method through the same data, backbone, optimizer, budget and
evaluation (``benchmarks.lightly_methods``), each run in a fresh process. Accuracies are
the mean, min and max over the seeds; the gain is each run's kNN less that of the same
seed's random-init encoder (the run's step 0), its smallest over the seeds. Finished runs
are kept in ``--saved-runs``: run again after an interruption, it trains only the rest.

    python -m benchmarks.methods              # 3 seeds: hours on 2 cores (the kNN runs)
    python -m benchmarks.methods --jobs 2     # two runs side by side, one thread each
    python -m benchmarks.methods --seeds 1    # one seed
    python -m benchmarks.methods --quick      # small sizes, 20 training steps per method
    python -m benchmarks.methods --methods swav  # one method's rows (SimCLR's step beside it)
    python -m benchmarks.methods --publish    # refresh docs/methods.md and benchmarks/results.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks import standalone
from benchmarks.fresh_process import in_fresh_process
from benchmarks.lightly_methods import LIGHTLY_METHODS
from contrastive_accelerate.config import flag
from contrastive_accelerate.data import load_image_dataset
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.methods import METHODS
from trainer import TrainConfig

#: The methods that train an image encoder from unlabelled images (``pairs`` needs pairs).
IMAGE_METHODS = ("simclr", "moco", "byol", "dino", "dinov2", "swav")
#: What a method takes besides ``--method``, in every run and step here: DINOv2 masks the
#: patches of a ViT, the others train the README's ResNet-18.
METHOD_OPTIONS = {"dinov2": {"model": "vit_micro"}}


def method_flags(name: str) -> list[str]:
    """``METHOD_OPTIONS[name]`` as command-line flags."""
    return [part for key, value in METHOD_OPTIONS.get(name, {}).items()
            for part in (flag(key), str(value))]  # fmt: skip


#: An epoch past any frozen ones (DINO's last layer): the steps timed are the steady state's.
STEADY_EPOCH = 10**9


def _built(name: str, batch_size: int, data):
    config = TrainConfig(method=name, batch_size=batch_size, **METHOD_OPTIONS.get(name, {}))
    config = config.resolved()
    torch.manual_seed(0)
    method = METHODS[name].build(config, data, 1, lambda _: None, total_steps=1000)
    optimizer = torch.optim.SGD(method.model.parameters(), lr=0.01, momentum=0.9)
    batch = method.dataset.collate([method.dataset[(0, index)] for index in range(batch_size)])
    return method, optimizer, batch


def _step(method, optimizer, batch, step: int) -> None:
    cached_backward(
        method.model,
        batch.split(1),
        partial(method.loss, batch=batch, sizes=None, step=step),
        forward=partial(method.embed, method.model, step=step),
    )
    method.before_optimizer_step(STEADY_EPOCH, step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.after_step(step)


def step_times(
    batch_size: int, rounds: int, methods: tuple[str, ...] = IMAGE_METHODS
) -> list[dict]:
    data = load_image_dataset(None)
    built = {name: _built(name, batch_size, data) for name in methods}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for step in range(rounds + 1):  # the first round warms up
        for name, (method, optimizer, batch) in built.items():
            started = time.perf_counter()
            _step(method, optimizer, batch, step)
            if step:
                seconds[name].append(time.perf_counter() - started)
    rows = []
    for name, (method, _, _) in built.items():
        ema = None
        if hasattr(method, "teacher"):
            updates = []
            for _ in range(rounds):
                started = time.perf_counter()
                method.teacher.update(method.model, 0.996)
                updates.append(time.perf_counter() - started)
            ema = statistics.median(updates)
        rows.append({"method": name, "step_s": statistics.median(seconds[name]), "ema_s": ema})
    return rows


def multicrop_rate(batch_size: int, batches: int) -> list[dict]:
    data = load_image_dataset(None)
    config = TrainConfig(method="dino").resolved()
    dataset = METHODS["dino"].build(config, data, 1, lambda _: None, total_steps=1).dataset
    rows = []
    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(
            [(0, index) for index in range(batch_size * batches)],
            batch_size=batch_size,
            num_workers=workers,
            collate_fn=lambda items: dataset.collate([dataset[item] for item in items]),
        )
        started = time.perf_counter()
        for _ in loader:
            pass
        rate = batch_size * batches / (time.perf_counter() - started)
        rows.append({"workers": workers, "samples_per_s": rate})
    return rows


def knn_run(name: str, extra: list[str], seed: int = 0, threads: int | None = None) -> dict:
    """The README's first command with ``--method name --seed seed`` (under
    ``OMP_NUM_THREADS=threads`` when given): its figures, the random-init encoder's kNN
    (step 0) included."""
    arguments = ["--method", name, *method_flags(name), "--seed", str(seed), *extra]
    result, seconds, records = standalone.readme_run(arguments, threads)
    if result.returncode != 0:
        return {"method": name, "seed": seed, "error": result.stderr[-500:]}
    row = {"implementation": "ours", "method": name, "seed": seed, "seconds": seconds}
    for record in records:
        if record.get("step") == 0 and "knn_top1" in record:
            row["knn_top1_init"] = record["knn_top1"]
        for key in ("knn_top1", "linear_probe_top1", "raw_pixels_knn_top1"):
            if key in record:
                row[key] = record[key]
    return row


def recipe(name: str, quick: bool) -> str:
    """A digest of what a kNN run of ``name`` trains with (its resolved options, the
    quick flag): a saved run counts for the table only while its recipe is today's."""
    return standalone.recipe_digest(TrainConfig(method=name, **METHOD_OPTIONS.get(name, {})), quick)


def knn_jobs(seeds: int, methods: tuple[str, ...] = IMAGE_METHODS) -> list[tuple[str, str, int]]:
    """Every (implementation, method, seed) of the table: ours for each method, lightly's
    beside DINO and BYOL."""
    return [
        (implementation, name, seed)
        for name in methods
        for seed in range(seeds)
        for implementation in ("ours", "lightly")
        if implementation == "ours" or name in LIGHTLY_METHODS
    ]


def knn_row(job: tuple[str, str, int], quick: bool, threads: int) -> dict:
    """One kNN run, in a fresh process on ``threads`` threads."""
    implementation, name, seed = job
    if implementation == "ours":
        row = knn_run(name, ["--max-steps", "20"] if quick else [], seed, threads)
    else:
        row = in_fresh_process("benchmarks.lightly_methods", "lightly_run", name, seed, quick,
                               env={"OMP_NUM_THREADS": str(threads)})  # fmt: skip
    return {**row, "implementation": implementation, "method": name, "seed": seed,
            "threads": threads}  # fmt: skip


def knn_rows(
    seeds: int, quick: bool, jobs: int, saved: Path | None, methods: tuple[str, ...] = IMAGE_METHODS
) -> list[dict]:
    """Every run of ``knn_jobs``, ``jobs`` at a time on an equal share of the cores each;
    those in ``saved`` of today's recipes are reused (``standalone.resumable_runs``)."""
    recipes = {name: recipe(name, quick) for name in methods}
    threads = max(1, (os.cpu_count() or 1) // jobs)
    return standalone.resumable_runs(
        knn_jobs(seeds, methods),
        partial(knn_row, quick=quick, threads=threads),
        job_of=lambda row: (row["implementation"], row["method"], row["seed"]),
        recipe_of=lambda job: recipes[job[1]],
        saved=saved,
        parallel=jobs,
    )


def run(
    quick: bool,
    seeds: int = 3,
    jobs: int = 1,
    saved: Path | None = None,
    methods: tuple[str, ...] = IMAGE_METHODS,
) -> dict:
    return {
        "steps": step_times(16 if quick else 128, 2 if quick else 7, ("simclr", *methods)),
        "multicrop": multicrop_rate(batch_size=16 if quick else 128, batches=2 if quick else 6),
        "knn_extra_args": ["--max-steps", "20"] if quick else [],
        "knn_jobs": jobs,
        "knn": knn_rows(seeds, quick, jobs, saved, methods),
    }


def with_earlier_rows(results: dict, earlier: dict | None) -> dict:
    """A run of some methods (``--methods``) completed by ``earlier``'s rows of the others,
    SimCLR's included. Each new method's step keeps its ratio to the SimCLR step timed
    beside it in this run, in milliseconds of the earlier run's SimCLR."""
    if not earlier:
        return results
    names = {row["method"] for row in results["steps"]} - {"simclr"}
    simclr = next(row["step_s"] for row in results["steps"] if row["method"] == "simclr")
    before = next(row["step_s"] for row in earlier["steps"] if row["method"] == "simclr")
    steps = [row for row in earlier["steps"] if row["method"] not in names]
    steps += [{**row, "step_s": row["step_s"] * before / simclr}
              for row in results["steps"] if row["method"] in names]  # fmt: skip
    knn = [row for row in earlier["knn"] if row["method"] not in names] + results["knn"]
    return {**earlier, "steps": steps, "knn": knn}


def _spread(rows: list[dict], key: str) -> str:
    """``mean [min, max]`` of ``key`` over ``rows`` as percentages; n/a when none has it."""
    values = [row[key] for row in rows if key in row]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.1%}"
    return f"{statistics.mean(values):.1%} [{min(values):.1%}, {max(values):.1%}]"


def _least_gain(rows: list[dict], init: dict[tuple[str, int], float]) -> str:
    """The smallest kNN gain over the same seed's random-init encoder, in points."""
    gains = [row["knn_top1"] - init[row["method"], row["seed"]] for row in rows
             if "knn_top1" in row and (row["method"], row["seed"]) in init]  # fmt: skip
    return f"{100 * min(gains):+.1f}" if gains else "n/a"


def _threads(rows: list[dict]) -> str:
    counts = sorted({row["threads"] for row in rows if "threads" in row})
    return " or ".join(map(str, counts)) + " thread(s)" if counts else "the default threads"


def table_lines(results: dict) -> list[str]:
    simclr = next(row["step_s"] for row in results["steps"] if row["method"] == "simclr")
    seeds = sorted({row["seed"] for row in results["knn"]})
    lines = [
        "| `--method` | step (ms) | vs simclr | EMA update (ms, share of the step) "
        f"| kNN top-1 ({len(seeds)} seed{'s' * (len(seeds) != 1)}: mean [min, max]) "
        "| kNN gain over the random init (min) | linear probe "
        "| lightly's kNN top-1 | lightly's kNN gain (min) | lightly's linear probe "
        "| run (s, median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours = [row for row in results["knn"] if row.get("implementation") == "ours"]
    # lightly's runs start from our run's initial encoder of the same method and seed.
    init = {(row["method"], row["seed"]): row["knn_top1_init"]
            for row in ours if "knn_top1_init" in row}  # fmt: skip
    for row in results["steps"]:
        ema = (
            f"{row['ema_s'] * 1e3:.1f} ({row['ema_s'] / row['step_s']:.1%})"
            if row["ema_s"] is not None
            else "none"
        )
        method = [evaluation for evaluation in ours if evaluation["method"] == row["method"]]
        lightly = [evaluation for evaluation in results["knn"]
                   if evaluation.get("implementation") == "lightly"
                   and evaluation["method"] == row["method"]]  # fmt: skip
        seconds = [evaluation["seconds"] for evaluation in method if "seconds" in evaluation]
        tower = METHOD_OPTIONS.get(row["method"], {}).get("model")
        lines.append(
            f"| `{row['method']}`{f' (`{tower}`)' if tower else ''} | {row['step_s'] * 1e3:.0f} "
            f"| {row['step_s'] / simclr:.2f}x "
            f"| {ema} | {_spread(method, 'knn_top1')} | {_least_gain(method, init)} "
            f"| {_spread(method, 'linear_probe_top1')} | {_spread(lightly, 'knn_top1')} "
            f"| {_least_gain(lightly, init)} | {_spread(lightly, 'linear_probe_top1')} "
            f"| {statistics.median(seconds) if seconds else float('nan'):.0f} |"
        )
    dino = next(row["step_s"] for row in results["steps"] if row["method"] == "dino")
    batch = 16 if results["knn_extra_args"] else 128
    rates = ", ".join(
        f"{row['samples_per_s']:.0f} samples/s with {row['workers']} workers"
        for row in results["multicrop"]
    )
    raw = next((row.get("raw_pixels_knn_top1") for row in ours), None)
    errors = [f"{row['method']} seed {row['seed']}: {row['error']}"
              for row in results["knn"] if "error" in row]  # fmt: skip
    lines += [
        "",
        f"Multi-crop loader (2 x 8 px + 6 x 4 px crops per digit): {rates}; DINO's step "
        f"consumes {batch / dino:.0f} samples/s. kNN on raw pixels of the same held-out "
        f"digits: {'n/a' if raw is None else f'{raw:.1%}'}; of the random-init encoder (the "
        f"runs' step 0, every method and seed): {_spread(ours, 'knn_top1_init')}. Seeds: "
        f"{', '.join(map(str, seeds))}; each run on {_threads(results['knn'])}, "
        f"{results.get('knn_jobs', 1)} at a time. Extra arguments of the kNN runs: "
        f"{' '.join(results['knn_extra_args']) or '(none: the default budget)'}.",
        *(f"Failed: {error}" for error in errors),
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 20 training steps")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1 per method")
    parser.add_argument(
        "--jobs", type=int, default=1, help="kNN runs side by side, the cores shared equally"
    )
    parser.add_argument(
        "--saved-runs",
        default="benchmarks/results/methods_runs.jsonl",
        help="finished kNN runs, appended as they end; those of today's recipes are reused",
    )
    parser.add_argument(
        "--methods", help="comma-separated: only these methods' rows, the others' kept"
    )
    standalone.add_output_arguments(parser, "methods")
    args = parser.parse_args()
    path = standalone.results_path(parser, args, "methods")
    methods = tuple(args.methods.split(",")) if args.methods else IMAGE_METHODS
    if not set(methods) <= set(IMAGE_METHODS):
        parser.error(f"--methods: choose among {', '.join(IMAGE_METHODS)}")
    saved = None if args.quick else Path(args.saved_runs)
    results = run(args.quick, args.seeds, args.jobs, saved, methods)
    if args.methods:
        results = with_earlier_rows(results, standalone.stored(path).get("methods"))
    standalone.merge(path, "methods", results)
    lines = table_lines(results)
    print("\n".join(lines))
    if args.publish:
        standalone.write_docs("methods", lines, "methods.md")


if __name__ == "__main__":
    main()
