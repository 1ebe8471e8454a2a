"""Input checks that every rank agrees on, so that bad input raises everywhere instead of hanging.

A loss that gathers or all-reduces must not raise on one rank while the others
enter the collective: they would wait for it until the collective timeout. Each
loss therefore checks its local inputs first, exchanges a problem code together
with the batch sizes in one small collective, and raises on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import all_gather_sizes, is_distributed

_SHAPES, _NOT_2D, _NOT_FINITE, _LABELS, _SCALARS = 1, 2, 3, 4, 5
_PROBLEMS = {
    _SHAPES: "the two inputs have different shapes",
    _NOT_2D: "inputs must be 2-D (batch, features)",
    _NOT_FINITE: "inputs contain NaN or Inf",
    _LABELS: "labels must be a 1-D integer tensor with one label per sample",
    _SCALARS: "logit_scale and logit_bias must be finite scalars",
}


def local_problem(
    x0: torch.Tensor,
    x1: torch.Tensor,
    labels: torch.Tensor | None = None,
    scalars: tuple = (),
) -> tuple[int, str] | None:
    """The first problem with this rank's inputs, as (code, message), or None."""
    if x0.shape != x1.shape:
        return _SHAPES, f"{_PROBLEMS[_SHAPES]}: {tuple(x0.shape)} and {tuple(x1.shape)}"
    if x0.dim() != 2:
        return _NOT_2D, f"{_PROBLEMS[_NOT_2D]}, got shape {tuple(x0.shape)}"
    if not (torch.isfinite(x0).all() and torch.isfinite(x1).all()):
        return _NOT_FINITE, _PROBLEMS[_NOT_FINITE]
    if labels is not None and (
        labels.dim() != 1
        or labels.shape[0] != x0.shape[0]
        or labels.is_floating_point()
        or labels.is_complex()
    ):
        shape = tuple(labels.shape)
        return _LABELS, f"{_PROBLEMS[_LABELS]}, got {labels.dtype} of shape {shape}"
    for scalar in scalars:
        value = scalar if isinstance(scalar, torch.Tensor) else torch.tensor(float(scalar))
        if value.numel() != 1 or not math.isfinite(float(value.detach())):
            return _SCALARS, _PROBLEMS[_SCALARS]
    return None


def batch_sizes(
    name: str, x: torch.Tensor, problem: tuple[int, str] | None, gather_distributed: bool
) -> tuple[int, int, list[int]]:
    """``(rank, world_size, every rank's batch size)``; raises ``ValueError`` on every rank
    when the inputs of any rank have a problem (one small collective when distributed)."""
    if not (gather_distributed and is_distributed()):
        if problem:
            raise ValueError(f"{name}: {problem[1]}")
        return 0, 1, [x.shape[0]]
    sizes, codes = all_gather_sizes(x, error_code=problem[0] if problem else 0)
    if problem:
        raise ValueError(f"{name}: {problem[1]}")
    for bad_rank, code in enumerate(codes):
        if code:
            raise ValueError(f"{name}: rank {bad_rank}: {_PROBLEMS[code]}")
    return dist.get_rank(), dist.get_world_size(), sizes


def require_global_batch(name: str, sizes: list[int], minimum: int, why: str) -> None:
    """Raise on every rank (``sizes`` are the same everywhere) if the global batch is too small."""
    if sum(sizes) < minimum:
        raise ValueError(
            f"{name}: the global batch has {sum(sizes)} sample(s); at least {minimum} are "
            f"needed {why}"
        )
