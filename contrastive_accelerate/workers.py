"""A pool of persistent worker processes: one process's code run on W ranks, without
W process starts per call.

``run_on_ranks(fn, W, ...)`` calls ``fn(rank, W, ...)`` on W workers joined in a gloo
group; ``run_in_workers`` on the same workers without a group, for code that makes its
own (a whole training run, as torchrun would start it). The invariance kit
(``contrastive_accelerate.testing``) and the tests run on it; every call has a
deadline, and workers whose call failed or hung are replaced.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

# Generous for a loaded 2-core CI machine, still far below CI's budget: a hung
# collective fails the test instead of the run.
COLLECTIVE_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 180
# A worker holds torch, accelerate and datasets: about 0.7 GB. Two pytest processes, each
# keeping workers of every size for each kind of call, ran a 24 GB machine out of memory.
# Now both kinds share them, and a process keeps at most this many (1 + 2 + 3), closing
# the least recently used first.
MAX_POOLED_WORKERS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Return ``[fn(rank, world_size, *args) for rank in ranks]`` computed in a gloo group
    of worker processes.

    ``fn`` must be importable (module level) and return picklable values; tensors
    should be converted to numpy or lists. A failure on any rank raises here with
    that rank's traceback; a hang raises after ``JOIN_TIMEOUT_S``. The workers are shared
    by every call with this world size, so a call costs its computation rather than W
    process starts; workers whose call failed or hung are replaced. ``fn`` therefore
    finds the process as the previous call left it: seed whatever it draws.
    """
    return run_in_group(
        fn, world_size, args, timeout_s=JOIN_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )


def run_in_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = JOIN_TIMEOUT_S
) -> list[Any]:
    """``run_on_ranks`` for code that makes its own process group: the same persistent
    worker processes, but without a process group, so that ``fn`` can launch a whole
    run in each, as torchrun would (a training script's ``Accelerator`` makes the group
    and ends it). ``fn`` is called as ``fn(rank, world_size, *args)``; pass it a fresh
    port for its rendezvous.
    """
    return _run(fn, world_size, args, timeout_s, None)


def run_in_group(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    *,
    timeout_s: float,
    collective_timeout_s: float,
) -> list[Any]:
    """``run_on_ranks`` with its deadlines given: the call's, and that of each collective
    of the workers' gloo group (made anew for it)."""
    return _run(fn, world_size, args, timeout_s, (free_port(), collective_timeout_s))


def _run(
    fn, world_size: int, args: tuple, timeout_s: float, rendezvous: tuple[int, float] | None
) -> list[Any]:
    workers = _shared_workers(world_size)
    try:
        return workers.run(fn, args, timeout_s, rendezvous)
    except BaseException:
        if not workers.reusable:
            _discard_workers(world_size)
        raise


_FAILURE_GRACE_S = 5.0
#: How often a call that waits for its ranks looks for a worker that died starting.
_POLL_S = 0.5


class WorkerStartError(ChildProcessError):
    """A worker process exited before it could serve: spawned workers import the caller's
    ``__main__`` again, which a script read from standard input (``python - <<EOF``) or an
    interactive session cannot give them."""


_TRANSPORT = re.compile(r"gloo|Connection (reset|closed)|pair\.cc|Timed out", re.I)


class _Workers:
    """W worker processes serving calls until closed.

    After a call that failed, ``reusable`` says whether they can serve the next: only if
    it was a check in their gloo group and every rank came back (its own error, or a
    result); that group is then made anew, since a collective may have been cut short.
    Workers of a call that hung, or of a trainer run that raised, are replaced."""

    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.reusable = True
        self.stale_group = False
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        self.started: set[int] = set()  # the ranks whose worker said it serves
        self.processes = [
            context.Process(target=_serve, args=(rank, world_size, self.tasks[rank], self.results))
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple,
        timeout_s: float,
        rendezvous: tuple[int, float] | None,
    ) -> list[Any]:
        """``fn`` on every rank: in a gloo group with the collective timeout of
        ``rendezvous = (port, seconds)``, made at that port unless the workers are in
        such a group of their own already; in none when ``rendezvous`` is None."""
        self.reusable = False
        for tasks in self.tasks:
            tasks.put((fn, args, rendezvous, self.stale_group))
        self.stale_group = False
        by_rank: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        gone_since = None  # when a worker was first seen dead without its result
        while len(by_rank) + len(failures) < self.world_size:
            try:
                wait = min(_POLL_S, max(0.1, deadline - time.monotonic()))
                rank, ok, value = self.results.get(timeout=wait)
            except queue.Empty:
                if self._exited_without_result(by_rank, failures):
                    # What it sent just before it died may still be in the pipe.
                    gone_since = gone_since or time.monotonic()
                    if time.monotonic() - gone_since > _FAILURE_GRACE_S:
                        self._raise_for_an_exited_worker(by_rank, failures)
                if time.monotonic() < deadline:
                    continue
                if failures:
                    break  # the others wait in a collective for the rank that failed
                missing = sorted(set(range(self.world_size)) - set(by_rank))
                returned = "".join(
                    f"\nrank {done} returned: {str(value)[-1000:]}"
                    for done, value in by_rank.items()
                )
                raise TimeoutError(
                    f"no result from ranks {missing} in {timeout_s:g} s{returned}"
                ) from None
            if ok is None:  # a worker's first word: it serves
                self.started.add(rank)
            elif ok:
                by_rank[rank] = value
            else:
                failures[rank] = value
                # A peer's own error follows within moments; a stuck one never comes.
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        if failures:
            every_rank_back = len(by_rank) + len(failures) == self.world_size
            self.reusable = self.stale_group = every_rank_back and rendezvous is not None
            # The rank whose own code failed, rather than one that lost its peer.
            rank = min(failures, key=lambda r: (_TRANSPORT.search(failures[r]) is not None, r))
            raise RuntimeError(f"rank {rank} failed:\n{failures[rank]}")
        self.reusable = True
        return [by_rank[rank] for rank in range(self.world_size)]

    def _exited_without_result(self, by_rank: dict[int, Any], failures: dict[int, str]) -> bool:
        return any(
            process.exitcode is not None and rank not in by_rank and rank not in failures
            for rank, process in enumerate(self.processes)
        )

    def _raise_for_an_exited_worker(
        self, by_rank: dict[int, Any], failures: dict[int, str]
    ) -> None:
        """Raise for a worker process gone without its result: one that never served
        (it could not import the caller), or one that died in the call (a signal, a
        native abort), whose peers would otherwise wait out the deadline."""
        for rank, process in enumerate(self.processes):
            code = process.exitcode
            if code is None or rank in by_rank or rank in failures:
                continue
            if rank not in self.started:
                raise WorkerStartError(
                    f"the worker process of rank {rank} exited (code {code}) "
                    "before it could serve: its error is on standard error above. Spawned "
                    "workers import the caller's __main__ again: run the check from a file "
                    "(a test module or a script), not from standard input or a notebook cell"
                )
            how = f"code {code}" if code >= 0 else f"signal {_signal_name(-code)}"
            returned = "".join(
                f"\nrank {done} returned: {str(value)[-1000:]}"
                for done, value in {**by_rank, **failures}.items()
            )
            raise ChildProcessError(
                f"the worker process of rank {rank} died in the call ({how}){returned}"
            )

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _serve(rank: int, world_size: int, tasks, results) -> None:
    from contrastive_accelerate.ranks import end_process_group

    parent = os.getppid()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    own = None  # the gloo group this worker made for run_on_ranks' calls
    results.put((rank, None, "started"))
    try:
        while (task := _next_task(tasks, parent)) is not None:
            fn, args, rendezvous, stale = task
            try:
                own = _default_group(None if stale else own, rendezvous, rank, world_size)
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    except BaseException:  # a task that cannot be unpickled: say so, do not go silent
        results.put((rank, False, traceback.format_exc()))
    finally:
        end_process_group()


def _default_group(own, rendezvous: tuple[int, float] | None, rank: int, world_size: int):
    """Make the default process group this worker's own gloo group ``own = (group,
    timeout)``, made anew at ``rendezvous = (port, timeout)`` if a call since has ended
    or replaced it or if it has another timeout; or no group for a call that makes its
    own (``rendezvous`` None). Every rank gets the same calls, so all agree."""
    import torch.distributed as dist

    from contrastive_accelerate.ranks import end_process_group

    current = dist.group.WORLD if dist.is_initialized() else None
    kept = own is not None and current is own[0] and rendezvous is not None
    if kept and own[1] == rendezvous[1]:
        return own
    if current is not None:
        end_process_group()
    if rendezvous is None:
        return None
    port, timeout_s = rendezvous
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD, timeout_s


_PARENT_POLL_S = 5.0


def _next_task(tasks, parent: int):
    """The next task, or None once the process that started this worker is gone (a
    killed pytest must not leave its workers holding memory)."""
    while True:
        try:
            return tasks.get(timeout=_PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return None


# One set of workers per world size for a whole test session, serving both kinds of
# calls: a check costs its computation, not W process starts. Workers that failed or hung
# are replaced. Ordered from least to most recently used.
_WORKERS: dict[int, _Workers] = {}


def _shared_workers(world_size: int) -> _Workers:
    workers = _WORKERS.pop(world_size, None)
    if workers is None or not workers.alive():
        if workers is not None:
            workers.kill()
        while _WORKERS and sum(_WORKERS) + world_size > MAX_POOLED_WORKERS:
            _WORKERS.pop(next(iter(_WORKERS))).close()
        workers = _Workers(world_size)
    _WORKERS[world_size] = workers
    return workers


def _discard_workers(world_size: int) -> None:
    workers = _WORKERS.pop(world_size, None)
    if workers is not None:
        workers.kill()


@atexit.register
def close_workers() -> None:
    """End every pooled worker of this process (at exit, or when a caller must know they
    are gone)."""
    for workers in _WORKERS.values():
        workers.close()
    _WORKERS.clear()


__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "JOIN_TIMEOUT_S",
    "MAX_POOLED_WORKERS",
    "WorkerStartError",
    "close_workers",
    "free_port",
    "run_in_group",
    "run_in_workers",
    "run_on_ranks",
]
