"""NT-Xent forward+backward: time and extra peak memory, ours (dense, tiled) vs lightly's.

Time: the implementations alternate within one process, median of ``repeats``.
Memory: each measurement runs in a fresh subprocess; extra peak = the process's
RSS high-water mark (``VmHWM``; not ``ru_maxrss``, which a child inherits from
its parent) minus RSS after the inputs exist, so it counts what the loss
allocates (logits, softmax, gradients), not the inputs or the interpreter.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.fresh_process import in_fresh_process, memory_status_bytes
from losses import NTXentLoss

TEMPERATURE = 0.5


def make_loss(name: str, tile_rows: int | None = None):
    if name == "lightly":
        from lightly.loss import NTXentLoss as LightlyNTXentLoss

        return LightlyNTXentLoss(temperature=TEMPERATURE)
    if name == "ours_tiled":
        return NTXentLoss(TEMPERATURE, tile_rows=tile_rows or 1024)
    return NTXentLoss(TEMPERATURE)


def _inputs(pairs: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out0 = torch.randn(pairs, dim, generator=generator)
    out1 = out0 + 0.3 * torch.randn(pairs, dim, generator=generator)
    return out0.requires_grad_(), out1.requires_grad_()


def _forward_backward(loss_fn, out0, out1) -> float:
    out0.grad = out1.grad = None
    loss = loss_fn(out0, out1)
    loss.backward()
    return loss.item()


def time_losses(names: list[str], pairs: int, dim: int = 128, repeats: int = 5) -> dict:
    """Median seconds per forward+backward, names interleaved; plus loss values."""
    out0, out1 = _inputs(pairs, dim)
    losses = {name: make_loss(name) for name in names}
    values = {name: _forward_backward(loss, out0, out1) for name, loss in losses.items()}  # warm
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name, loss in losses.items():
            started = time.perf_counter()
            _forward_backward(loss, out0, out1)
            seconds[name].append(time.perf_counter() - started)
    return {
        name: {"seconds": statistics.median(seconds[name]), "loss": values[name]} for name in names
    }


def _measure_here(name: str, pairs: int, dim: int, tile_rows: int | None) -> dict:
    loss_fn = make_loss(name, tile_rows)
    out0, out1 = _inputs(pairs, dim)
    baseline = memory_status_bytes("VmRSS")
    started = time.perf_counter()
    value = _forward_backward(loss_fn, out0, out1)
    seconds = time.perf_counter() - started
    peak = memory_status_bytes("VmHWM")
    return {"extra_peak_bytes": max(0, peak - baseline), "seconds": seconds, "loss": value}


def peak_memory(
    name: str, pairs: int, dim: int = 128, tile_rows: int | None = None, timeout: int = 900
) -> dict:
    """Extra peak memory of one forward+backward, measured in a fresh process."""
    return in_fresh_process(
        "benchmarks.loss", "_measure_here", name, pairs, dim, tile_rows, timeout=timeout
    )
