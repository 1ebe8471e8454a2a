"""Gather backward on 2 gloo processes: three ways to get it right.

- reduce_scatter: each rank receives only its own summed rows
  (``contrastive_accelerate.collectives.gather``).
- all_reduce: all-reduce the whole stacked gradient, then keep this rank's rows
  (the fallback for backends without reduce-scatter).
- torch_nn_functional: ``torch.distributed.nn.functional.all_gather``.
Each rank applies a different loss so that the gradients differ per rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import gather
from contrastive_accelerate.testing import run_on_ranks


def _torch_gather(x: torch.Tensor) -> torch.Tensor:
    import warnings

    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():  # it warns that it is deprecated, on every call
        warnings.simplefilter("ignore")
        return torch.cat(all_gather(x))


def _equal_sizes(x: torch.Tensor) -> list[int]:
    return [x.shape[0]] * dist.get_world_size()


VARIANTS = {
    "reduce_scatter": lambda x: gather(x, sizes=_equal_sizes(x)),
    "all_reduce": lambda x: gather(x, sizes=_equal_sizes(x), backward="all_reduce"),
    "torch_nn_functional": _torch_gather,
}


def _gather_worker(rank: int, world_size: int, rows: int, dim: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    x = torch.randn(rows, dim, requires_grad=True)
    weights = torch.randn(rows * world_size, dim)  # a different loss on every rank
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for repeat in range(repeats + 1):
        for name, variant in VARIANTS.items():
            x.grad = None
            loss = (variant(x) * weights).sum()
            dist.barrier()
            started = time.perf_counter()
            loss.backward()  # the backward alone: where the variants differ
            elapsed = time.perf_counter() - started
            if repeat:  # the first round warms up
                seconds[name].append(elapsed)
    return {name: statistics.median(values) for name, values in seconds.items()}


def time_gathers(rows_per_rank: list[int], dim: int = 128, repeats: int = 7) -> list[dict]:
    results = []
    for rows in rows_per_rank:
        per_rank = run_on_ranks(_gather_worker, 2, rows, dim, repeats)
        # A collective finishes when its slowest rank does.
        seconds = {name: max(result[name] for result in per_rank) for name in VARIANTS}
        results.append({"rows_per_rank": rows, "dim": dim, "seconds": seconds})
    return results
