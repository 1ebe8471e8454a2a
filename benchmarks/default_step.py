"""Where the default run's time goes: its step in parts (data, forward, loss, backward,
optimizer), its evaluation, and the FLOPs of a step at this machine's own matmul rate.

One process on every core (the README's first command's threads), the default options,
and the method, model, optimizer and loader as ``trainer.train`` builds them. Each part
is the median of ``--steps`` steps timed alone: the loader's batches with nothing else
running (its workers producing), then forward, loss, backward and optimizer on those
batches. The whole step is the trainer's own: ``train`` for 3 x ``--steps`` steps, its
logged samples per second (the loop as it runs, the loader beside it). The FLOPs are
counted by ``torch.utils.flop_counter`` over forward, loss and backward; the matmul
rate is float32 ``torch.matmul`` of 1024 x 1024 on the same threads. ``ideal`` is
FLOPs / rate: the time the step's arithmetic takes at that rate.

    python -m benchmarks.default_step             # about a minute on 2 cores
    python -m benchmarks.default_step --publish   # refresh docs/benchmarks.md's table
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch
from accelerate.utils import set_seed
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import standalone
from contrastive_accelerate.data import batches_per_epoch, train_loader, workers_stopped_on_exit
from contrastive_accelerate.knn import knn_data, knn_top1
from contrastive_accelerate.launch import make_accelerator
from contrastive_accelerate.methods import METHODS
from contrastive_accelerate.optim import make_optimizer
from trainer import TrainConfig, train

#: The parts of a step timed alone, then the whole step.
PARTS = ("data", "forward", "loss", "backward", "optimizer", "step")


def matmul_rate(size: int = 1024, repeats: int = 20) -> float:
    """float32 FLOP/s of ``torch.matmul`` on this process's threads (median of repeats)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(times)


def _timed(function) -> tuple[object, float]:
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def measure(steps: int) -> dict:
    config = TrainConfig().resolved()
    accelerator = make_accelerator("unused", "none", None)
    data = METHODS[config.method].load(config)
    set_seed(config.seed)
    method = METHODS[config.method].build(
        config, data, 1, lambda *_: None, total_steps=steps, device=accelerator.device
    )
    model = method.model
    optimizer = make_optimizer(config.optimizer, model.parameters(), lr=config.lr,
                               momentum=config.momentum,
                               weight_decay=config.weight_decay)  # fmt: skip
    loader, sampler = train_loader(method.dataset, accelerator, batch_size=config.batch_size,
                                   seed=config.seed, drop_last=config.drop_last,
                                   num_workers=config.num_workers)  # fmt: skip
    with workers_stopped_on_exit(loader):
        sampler.set_epoch(0, 0)
        batches, parts = [], {name: [] for name in PARTS}
        iterator = iter(loader)
        next(iterator)  # the workers started
        for _ in range(steps):
            batch, seconds = _timed(lambda: next(iterator))
            batches.append(batch)
            parts["data"].append(seconds)
        clock = time.perf_counter
        for step, batch in enumerate(batches):
            marks = [clock()]
            outputs = [method.embed(model, batch, step=step)]
            marks.append(clock())
            loss = method.loss(outputs, batch=batch, sizes=None, step=step)
            marks.append(clock())
            loss.backward()
            marks.append(clock())
            optimizer.step()
            optimizer.zero_grad()
            marks.append(clock())
            for name, start, end in zip(PARTS[1:5], marks[:-1], marks[1:], strict=True):
                parts[name].append(end - start)
        with FlopCounterMode(display=False) as counter:
            outputs = [method.embed(model, batches[0], step=0)]
            method.loss(outputs, batch=batches[0], sizes=None, step=0).backward()
        optimizer.zero_grad()
    with tempfile.TemporaryDirectory() as output:
        run = train(dataclasses.replace(config, max_steps=steps * 3, knn_k=0, output_dir=output))
    parts["step"] = [config.batch_size / run.metrics["samples_per_s"]]
    knn = knn_data(data.train, data.evaluation, data.image_column, data.label_column,
                   config.image_size, skip_unreadable=False)  # fmt: skip
    model.eval()
    _, evaluation = _timed(lambda: knn_top1(method.evaluated_encoder(), knn, k=config.knn_k))
    rate = matmul_rate()
    return {
        "threads": torch.get_num_threads(),
        "workers": loader.num_workers,
        "steps": steps,
        "median_seconds": {name: statistics.median(times) for name, times in parts.items()},
        "knn_evaluation_seconds": evaluation,
        "flops_per_step": counter.get_total_flops(),
        "matmul_flops_per_second": rate,
        "total_steps": config.epochs
        * batches_per_epoch(len(data.train), config.batch_size, config.drop_last),
    }


def table_lines(results: dict) -> list[str]:
    parts = results["median_seconds"]
    ideal = results["flops_per_step"] / results["matmul_flops_per_second"]
    compute = sum(parts[name] for name in ("forward", "loss", "backward", "optimizer"))
    lines = [
        "| part of the default run's step | median (ms) |",
        "|---|---|",
        *(
            f"| {name} | {parts[name] * 1e3:.0f} |"
            for name in ("data", "forward", "loss", "backward", "optimizer")
        ),  # fmt: skip
        f"| forward + loss + backward + optimizer | {compute * 1e3:.0f} |",
        f"| the whole step (the trainer's loop) | {parts['step'] * 1e3:.0f} |",
        f"| ideal: {results['flops_per_step'] / 1e9:.1f} GFLOP at "
        f"{results['matmul_flops_per_second'] / 1e9:.0f} GFLOP/s (float32 matmul) "
        f"| {ideal * 1e3:.0f} |",
        "",
        f"The whole step is {parts['step'] / ideal:.1f}x the ideal, forward to optimizer "
        f"{compute / ideal:.1f}x; the loader alone produces a batch in "
        f"{parts['data'] * 1e3:.0f} ms on {results['workers']} worker(s) beside "
        f"{results['threads']} compute threads. One kNN evaluation (bank and queries "
        f"decoded and embedded): {results['knn_evaluation_seconds']:.1f} s. Over the run's "
        f"{results['total_steps']} steps the step's median gives "
        f"{parts['step'] * results['total_steps'] / 60:.1f} min. Median of "
        f"{results['steps']} steps each.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps timed per part")
    parser.add_argument("--publish", action="store_true", help="refresh docs/benchmarks.md")
    args = parser.parse_args()
    results = measure(args.steps)
    standalone.merge(standalone.RESULTS / "results.json", "default_step", results)
    lines = table_lines(results)
    print("\n".join(lines))
    if args.publish:
        standalone.merge(standalone.PUBLISHED, "default_step", results)
        standalone.write_docs("default_step", lines, "benchmarks.md")


if __name__ == "__main__":
    main()
