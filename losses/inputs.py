"""Input checks that every rank agrees on, so that bad input raises everywhere instead of hanging.

A loss that gathers or all-reduces must not raise on one rank while the others
enter the collective: they would wait for it until the collective timeout. Each
loss therefore checks its local inputs first, exchanges a problem code together
with the batch sizes in one small collective, and raises on every rank.

Called with ``sizes`` (every rank's row count, known to the caller: the trainer's
sampler knows them), a loss exchanges nothing and reads no device value, so that a
training step never waits for the device. Then:

- shape problems, which are host metadata, still raise (on every rank, when every
  rank runs the same model, as under DDP);
- a rank whose row count is not its entry of ``sizes`` trains that step on its rows
  cut or zero-padded to it, so that every collective still matches, and notes the
  problem in ``sizes.problems`` when the caller passes a ``ShareSizes`` (the trainer's
  ``StepChecks`` raises it on every rank at its next check); given a plain list, it
  raises at once on that rank, and the other ranks fail at the collective timeout;
- values are not checked: NaN or Inf in the inputs (or a non-finite scale) give a
  non-finite loss, which the caller checks when it reads the loss anyway.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import ShareSizes, all_gather_sizes, is_distributed

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
    values: bool = True,
) -> tuple[int, str] | None:
    """The first problem with this rank's inputs, as (code, message), or None; without
    ``values``, only what the host knows (shapes, dtypes), with no device read."""
    if x0.shape != x1.shape:
        return _SHAPES, f"{_PROBLEMS[_SHAPES]}: {tuple(x0.shape)} and {tuple(x1.shape)}"
    if x0.dim() != 2:
        return _NOT_2D, f"{_PROBLEMS[_NOT_2D]}, got shape {tuple(x0.shape)}"
    if values and not (torch.isfinite(x0).all() and torch.isfinite(x1).all()):
        return _NOT_FINITE, _PROBLEMS[_NOT_FINITE]
    if labels is not None and (
        labels.dim() != 1
        or labels.shape[0] != x0.shape[0]
        or labels.is_floating_point()
        or labels.is_complex()
    ):
        shape = tuple(labels.shape)
        return _LABELS, f"{_PROBLEMS[_LABELS]}, got {labels.dtype} of shape {shape}"
    for scalar in scalars if values else ():
        value = scalar if isinstance(scalar, torch.Tensor) else torch.tensor(float(scalar))
        if value.numel() != 1 or not math.isfinite(float(value.detach())):
            return _SCALARS, _PROBLEMS[_SCALARS]
    return None


class CheckedBatch(NamedTuple):
    rank: int
    world_size: int
    sizes: list[int]  # every rank's number of rows, the same on every rank
    inputs: tuple  # the inputs, with this rank's ``sizes[rank]`` rows


def check_batch(
    name: str,
    x0: torch.Tensor,
    x1: torch.Tensor,
    labels: torch.Tensor | None = None,
    scalars: tuple = (),
    *,
    gather_distributed: bool,
    sizes: list[int] | None = None,
) -> CheckedBatch:
    """Check a loss's inputs on every rank and learn every rank's batch size.

    Without ``sizes``: one small collective when distributed, and ``ValueError`` on every
    rank when any rank's inputs have a problem. With ``sizes``: no collective and no
    device read (see the module's docstring). ``inputs`` are ``(x0, x1, labels)``.
    """
    distributed = gather_distributed and is_distributed()
    problem = local_problem(x0, x1, labels, scalars, values=sizes is None)
    if not distributed:
        if problem:
            raise ValueError(f"{name}: {problem[1]}")
        return CheckedBatch(0, 1, [x0.shape[0]], (x0, x1, labels))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if sizes is None:
        sizes, codes = all_gather_sizes(x0, error_code=problem[0] if problem else 0)
        if problem:
            raise ValueError(f"{name}: {problem[1]}")
        for bad_rank, code in enumerate(codes):
            if code:
                raise ValueError(f"{name}: rank {bad_rank}: {_PROBLEMS[code]}")
        return CheckedBatch(rank, world_size, sizes, (x0, x1, labels))
    if problem:
        raise ValueError(f"{name}: {problem[1]}")
    if len(sizes) != world_size:
        raise ValueError(f"{name}: sizes has {len(sizes)} entries for {world_size} ranks")
    inputs = (x0, x1, labels)
    if x0.shape[0] != sizes[rank]:
        message = (
            f"{name}: rank {rank} has {x0.shape[0]} rows where the given sizes say "
            f"{sizes[rank]} ({list(sizes)})"
        )
        if not isinstance(sizes, ShareSizes):
            raise ValueError(message)
        sizes.problems.append(message)
        inputs = tuple(None if t is None else _fit_rows(t, sizes[rank]) for t in inputs)
    return CheckedBatch(rank, world_size, list(sizes), inputs)


def _fit_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] >= rows:
        return x[:rows]
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def require_global_batch(name: str, sizes: list[int], minimum: int, why: str) -> None:
    """Raise on every rank (``sizes`` are the same everywhere) if the global batch is too small."""
    if sum(sizes) < minimum:
        raise ValueError(
            f"{name}: the global batch has {sum(sizes)} sample(s); at least {minimum} are "
            f"needed {why}"
        )
