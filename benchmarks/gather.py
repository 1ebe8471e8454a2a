"""Gather backward on 2 gloo processes: the exact collectives against torch's.

- reduce_scatter: each rank receives only its own summed rows.
- all_to_all: each rank receives every rank's gradient of its rows and sums them.
- all_reduce: all-reduce the whole stacked gradient, then keep this rank's rows.
- auto: ``contrastive_accelerate.collectives.gather``'s default, one of the three chosen
  by the backend (``AUTO_BACKWARD``).
- torch_nn_functional: ``torch.distributed.nn.functional.all_gather``.

Each rank applies a different loss so that the gradients differ per rank; sizes are
passed, so no variant exchanges them.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from benchmarks import standalone
from contrastive_accelerate.collectives import AUTO_BACKWARD, GATHER_BACKWARDS, gather
from contrastive_accelerate.testing import run_on_ranks


def _torch_gather(x: torch.Tensor) -> torch.Tensor:
    import warnings

    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():  # it warns that it is deprecated, on every call
        warnings.simplefilter("ignore")
        return torch.cat(all_gather(x))


def _ours(x: torch.Tensor, backward: str) -> torch.Tensor:
    return gather(x, sizes=[x.shape[0]] * dist.get_world_size(), backward=backward)


VARIANTS = {
    **{name: partial(_ours, backward=name) for name in GATHER_BACKWARDS if name != "auto"},
    "auto": partial(_ours, backward="auto"),
    "torch_nn_functional": _torch_gather,
}


def _gather_worker(rank: int, world_size: int, rows: int, dim: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    x = torch.randn(rows, dim, requires_grad=True)
    weights = torch.randn(rows * world_size, dim)  # a different loss on every rank
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for repeat in range(repeats + 1):
        for name, variant in VARIANTS.items():  # interleaved: drift hits all of them alike
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


def run(quick: bool) -> dict:
    rows = [256, 4096] if quick else [256, 4096, 32768]
    timed = time_gathers(rows, repeats=5 if quick else 15)
    return {"auto_on_gloo": AUTO_BACKWARD["gloo"], "rows": timed}


def table_lines(results: dict) -> list[str]:
    lines = [
        f"Gather backward, 2 gloo processes, d=128, fp32 (median); `auto` is "
        f"{results['auto_on_gloo']} on gloo",
        "",
        "| rows per rank | reduce-scatter | all-to-all + sum | all-reduce + slice | auto (ours) "
        "| torch.distributed.nn all_gather | auto / torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        s = {name: value * 1e3 for name, value in row["seconds"].items()}
        lines.append(
            f"| {row['rows_per_rank']} | {s['reduce_scatter']:.2f} ms | {s['all_to_all']:.2f} ms "
            f"| {s['all_reduce']:.2f} ms | {s['auto']:.2f} ms | {s['torch_nn_functional']:.2f} ms "
            f"| {s['auto'] / s['torch_nn_functional']:.2f} |"
        )
    return lines


if __name__ == "__main__":
    standalone.main("gather", __doc__.split("\n")[0], run, table_lines)
