"""Run a function on W local processes joined in a gloo group, with timeouts (tests, benchmarks)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

# Generous for a loaded 2-core CI machine, still far below CI's budget: a hung
# collective fails the test instead of the run.
COLLECTIVE_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Return ``[fn(rank, world_size, *args) for rank in ranks]`` computed in a gloo group.

    ``fn`` must be importable (module level) and return picklable values; tensors
    should be converted to numpy or lists. A failure on any rank raises here with
    that rank's traceback; a hang raises after ``JOIN_TIMEOUT_S``.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(fn, rank, world_size, port, results, args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    by_rank: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=JOIN_TIMEOUT_S)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            by_rank[rank] = value
    except queue.Empty:
        missing = sorted(set(range(world_size)) - set(by_rank))
        raise TimeoutError(f"no result from ranks {missing} in {JOIN_TIMEOUT_S} s") from None
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [by_rank[rank] for rank in range(world_size)]


def _worker(fn, rank, world_size, port, results, args):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
