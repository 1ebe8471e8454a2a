"""NT-Xent forward+backward: time and extra peak memory, ours (dense, tiled) vs lightly's.

Time: the implementations alternate within one process, median of ``repeats``.
Memory: each measurement runs in a fresh subprocess; extra peak = the process's
RSS high-water mark (``VmHWM``; not ``ru_maxrss``, which a child inherits from
its parent) minus RSS after the inputs exist, so it counts what the loss
allocates (logits, softmax, gradients), not the inputs or the interpreter.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

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


def _memory_status_bytes(field: str) -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure_here(name: str, pairs: int, dim: int, tile_rows: int | None) -> dict:
    loss_fn = make_loss(name, tile_rows)
    out0, out1 = _inputs(pairs, dim)
    baseline = _memory_status_bytes("VmRSS")
    started = time.perf_counter()
    value = _forward_backward(loss_fn, out0, out1)
    seconds = time.perf_counter() - started
    peak = _memory_status_bytes("VmHWM")
    return {"extra_peak_bytes": max(0, peak - baseline), "seconds": seconds, "loss": value}


def peak_memory(
    name: str, pairs: int, dim: int = 128, tile_rows: int | None = None, timeout: int = 900
) -> dict:
    """Extra peak memory of one forward+backward, measured in a fresh process."""
    code = (
        f"import json, benchmarks.loss as b; "
        f"print(json.dumps(b._measure_here({name!r}, {pairs}, {dim}, {tile_rows!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])
