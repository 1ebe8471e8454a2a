"""Gradient caching: peak memory and time of one training step against the chunk count K.

At a fixed global batch, each (model, K, method) runs in a fresh process: extra peak
memory is the RSS high-water mark (``VmHWM``) minus the RSS once the model, optimizer
and batch exist, so it counts activations and gradients; time is the median step
after one warm-up. ``cached`` is ``cached_backward`` (every negative, one extra
forward); ``plain`` is plain gradient accumulation (each chunk's own negatives: a
different objective, shown for its cost only). The dropout table times the ViT's
step with per-sample masks against torch's ``nn.Dropout``, interleaved in one process.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from benchmarks import standalone
from benchmarks.fresh_process import in_fresh_process, memory_status_bytes
from contrastive_accelerate.data import TwoViewBatch, load_image_dataset
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.methods import SimCLRMethod
from trainer import TrainConfig


def _setup(model_name: str, pairs: int, image_size: int, per_sample_dropout: bool = True):
    """The trainer's own SimCLR method (NT-Xent), its optimizer and a random batch."""
    masks = "per-sample" if per_sample_dropout else "per-process"
    config = TrainConfig(model=model_name, image_size=image_size, dropout_masks=masks)
    torch.manual_seed(0)
    method = SimCLRMethod(config.resolved(), load_image_dataset(None), 1, say=lambda _: None)
    optimizer = torch.optim.SGD(method.model.parameters(), lr=0.01, momentum=0.9)
    views = torch.randn(2, pairs, 3, image_size, image_size)
    return method, optimizer, TwoViewBatch(views[0], views[1], torch.arange(pairs), [])


def _step(method, optimizer, batch, chunks: int, kind: str, step: int) -> None:
    """One step through the method's own chunk embedding and loss assembly."""
    embed = partial(method.embed, method.model, step=step)
    if kind == "cached":
        loss_of = partial(method.loss, batch=batch, sizes=None, step=step)
        cached_backward(method.model, batch.split(chunks), loss_of, forward=embed)
    else:  # plain accumulation: each chunk's loss with its own negatives
        for piece in batch.split(chunks):
            (method.loss([embed(piece)], piece, None, step) / chunks).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _measure_here(model_name: str, pairs: int, image_size: int, chunks: int, method: str, steps):
    trained, optimizer, batch = _setup(model_name, pairs, image_size)
    baseline = memory_status_bytes("VmRSS")
    seconds = []
    for step in range(steps + 1):  # the first is a warm-up
        started = time.perf_counter()
        _step(trained, optimizer, batch, chunks, method, step)
        seconds.append(time.perf_counter() - started)
    peak = memory_status_bytes("VmHWM")
    return {"extra_peak_bytes": max(0, peak - baseline), "seconds": statistics.median(seconds[1:])}


def measure(model_name: str, pairs: int, image_size: int, chunks: int, method: str, steps: int):
    """``_measure_here`` in a fresh process, so that its high-water mark is its own."""
    return in_fresh_process(
        "benchmarks.grad_cache",
        "_measure_here",
        model_name,
        pairs,
        image_size,
        chunks,
        method,
        steps,
    )


def dropout_cost(pairs: int, image_size: int, repeats: int) -> dict:
    """ViT-Tiny step time with per-sample dropout against nn.Dropout, runs alternating."""
    setups = {
        "per_sample": _setup("vit_tiny", pairs, image_size, per_sample_dropout=True),
        "nn_dropout": _setup("vit_tiny", pairs, image_size, per_sample_dropout=False),
    }
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    for step in range(repeats + 1):
        for name, (trained, optimizer, batch) in setups.items():
            started = time.perf_counter()
            _step(trained, optimizer, batch, 1, "cached", step)
            if step:  # the first round warms up
                seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {"seconds": median, "ratio": median["per_sample"] / median["nn_dropout"]}


def run(quick: bool) -> dict:
    pairs, image_size = (32, 16) if quick else (256, 32)
    chunk_counts = [1, 4] if quick else [1, 2, 4, 8]
    steps = 1 if quick else 2
    rows = []
    for model_name in ("resnet18", "vit_tiny"):
        for chunks in chunk_counts:
            row = {"model": model_name, "chunks": chunks}
            for method in ("cached", "plain"):
                if method == "plain" and chunks == 1:
                    row[method] = row["cached"]  # the same single pass
                    continue
                row[method] = measure(model_name, pairs, image_size, chunks, method, steps)
            rows.append(row)
            print(f"gradient caching {model_name} K={chunks}: done", flush=True)
    return {
        "pairs": pairs,
        "image_size": image_size,
        "rows": rows,
        "dropout": dropout_cost(pairs // 2, image_size, repeats=2 if quick else 5),
    }


def table_lines(results: dict) -> list[str]:
    mib = 2**20
    lines = [
        f"Gradient caching, one SGD step at global batch {results['pairs']} pairs, "
        f"{results['image_size']} px, 1 process, fp32 (extra peak memory; median step time; "
        "ratios against K = 1 of the same model)",
        "",
        "| model | K | cached: memory | cached: time | plain accumulation: memory "
        "| plain accumulation: time |",
        "|---|---|---|---|---|---|",
    ]
    first: dict = {}
    for row in results["rows"]:
        first.setdefault(row["model"], row["cached"])
        base = first[row["model"]]

        def cell(entry, base=base):
            if "error" in entry:
                return f"failed: {entry['error']}", ""
            memory = entry["extra_peak_bytes"] / mib
            return (
                f"{memory:.0f} MiB ({entry['extra_peak_bytes'] / base['extra_peak_bytes']:.2f}x)",
                f"{entry['seconds']:.2f} s ({entry['seconds'] / base['seconds']:.2f}x)",
            )

        cached, plain = cell(row["cached"]), cell(row["plain"])
        lines.append(
            f"| {row['model']} | {row['chunks']} | {cached[0]} | {cached[1]} "
            f"| {plain[0]} | {plain[1]} |"
        )
    dropout = results["dropout"]
    lines += [
        "",
        f"Per-sample dropout in ViT-Tiny's training step (dropout 0.1, {results['pairs'] // 2} "
        f"pairs, {results['image_size']} px, median of interleaved runs): "
        f"{dropout['seconds']['per_sample']:.3f} s against nn.Dropout's "
        f"{dropout['seconds']['nn_dropout']:.3f} s, ratio {dropout['ratio']:.3f}",
    ]
    return lines


if __name__ == "__main__":
    standalone.main("grad_cache", __doc__.split("\n")[0], run, table_lines)
