"""What the two-view losses share: their inputs normalised and gathered the same way."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from losses.distributed import gather
from losses.precision import compute_dtype


def check_temperature(name: str, temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{name}: temperature must be positive, got {temperature}")


def normalized(out0: torch.Tensor, out1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views L2-normalised in the loss's compute dtype (float32, or float64)."""
    dtype = compute_dtype(out0, out1)
    return F.normalize(out0.to(dtype), dim=1), F.normalize(out1.to(dtype), dim=1)


def views_and_keys(
    z0: torch.Tensor, z1: torch.Tensor, rank: int, world_size: int, sizes: list[int]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's rows ``[z0; z1]``; every rank's rows, gathered in rank order with
    gradients (the keys: rank r's block is its n_r first views, then its n_r second
    views); and the column of this rank's first row among the keys."""
    local = torch.cat([z0, z1])
    keys = gather(local, sizes=[2 * size for size in sizes]) if world_size > 1 else local
    return local, keys, 2 * sum(sizes[:rank])
