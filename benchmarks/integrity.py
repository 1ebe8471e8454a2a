"""What a checkpoint's integrity checks cost per GB, next to writing it.

A float32 state of ``--quick`` 64 MiB or 1 GiB, as 64 equal tensors (a model's and its
optimizer's state come as many tensors of a few MB each): the finiteness check that every
save and load runs (``durable_files.check_finite``: one ``aminmax`` pass per tensor), the
content digest that a sharded checkpoint's reader recomputes for each shard it reads
(``durable_files.content_digest``: SHA-256 over names, shapes and bytes), the write of the
same tensors as one safetensors file flushed to disk (``write_tensors``: the copy, the
finiteness check, the digest, the write and the fsync), which both checks are compared
with. Medians of 3 rounds, one process, in seconds per GB (10^9 bytes).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import standalone

TENSORS = 64


def _median_seconds(work, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(quick: bool) -> dict:
    from contrastive_accelerate.durable_files import check_finite, content_digest, write_tensors

    total_bytes = (64 if quick else 1024) * 2**20
    generator = torch.Generator().manual_seed(0)
    state = {
        f"layer{index}.weight": torch.randn(total_bytes // 4 // TENSORS, generator=generator)
        for index in range(TENSORS)
    }
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "state.safetensors")
        seconds = {
            "finiteness check": _median_seconds(
                lambda: [check_finite(name, tensor) for name, tensor in state.items()]
            ),
            "content digest (SHA-256)": _median_seconds(lambda: content_digest(state)),
            "write (copy, check, digest, write, fsync)": _median_seconds(
                lambda: write_tensors(path, state)
            ),
        }
    return {
        "bytes": total_bytes,
        "tensors": TENSORS,
        "cpu_threads": torch.get_num_threads(),
        "seconds_per_gb": {name: value * 1e9 / total_bytes for name, value in seconds.items()},
    }


def table_lines(results: dict) -> list[str]:
    per_gb = results["seconds_per_gb"]
    write = per_gb["write (copy, check, digest, write, fsync)"]
    lines = [
        f"Checkpoint integrity, a float32 state of {results['bytes'] / 2**20:.0f} MiB in "
        f"{results['tensors']} tensors, 1 process, {results['cpu_threads']} threads "
        "(seconds per GB; share of the write)",
        "",
        "| work | s/GB | share of the write |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {value:.3f} | {value / write:.0%} |" for name, value in per_gb.items()]
    return lines


if __name__ == "__main__":
    standalone.main("integrity", __doc__.split("\n")[0], run, table_lines)
