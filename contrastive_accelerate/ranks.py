"""Keeping ranks in step when one of them has something to say.

A problem seen by one rank (an unreadable image, a full disk, a signal) must reach
every rank before the next collective, or the others wait in it until the
collective timeout. These helpers exchange that news at points where all ranks
are anyway, and raise the same one-line error everywhere.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import ShareSizes, host_group, is_distributed
from contrastive_accelerate.compat import default_store

T = TypeVar("T")


def any_rank(*flags: bool) -> list[bool]:
    """For each flag, whether it is set on any rank: one small all-reduce on the host
    (``collectives.host_group``), so that the host never waits for the device for it."""
    if not is_distributed():
        return list(flags)
    values = torch.tensor([int(flag) for flag in flags], dtype=torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=host_group())
    return [bool(value) for value in values.tolist()]


def total_over_ranks(count: int) -> int:
    """The sum of ``count`` over the ranks, every rank calling it: one small all-reduce on
    the host, as ``any_rank``."""
    if not is_distributed():
        return count
    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value, group=host_group())
    return int(value.item())


#: "No step yet": the value of ``StepChecks``' first non-finite step until there is one.
_NEVER = 2**62


class StepChecks:
    """What the training steps find out without making the host wait for the device,
    raised on every rank at the steps that read device values anyway (logging, saving).

    ``record`` runs every step and only queues device work; ``raise_if_any`` is a
    collective, called by every rank at the same steps. A problem raises at the latest
    at the next check, so a non-finite loss is never logged or saved.
    """

    def __init__(self, device: torch.device) -> None:
        self.first_non_finite = torch.full((), _NEVER, dtype=torch.int64, device=device)
        self.problems: list[str] = []

    def known_sizes(self, sizes: list[int]) -> ShareSizes:
        """Every rank's number of rows, for the losses: those that find this rank's rows
        differ note it here (``losses.inputs``), and ``raise_if_any`` raises it."""
        return ShareSizes(sizes, self.problems)

    def record(self, step: int, loss: torch.Tensor) -> None:
        """Remember ``step`` if ``loss`` is not finite (no host read)."""
        this_step = torch.where(torch.isfinite(loss), _NEVER, step)
        self.first_non_finite = torch.minimum(self.first_non_finite, this_step)

    def raise_if_any(self) -> None:
        """Raise on every rank if any rank recorded a problem since the start (one small
        all-reduce and one read; the messages travel only when there is one)."""
        problems, self.problems[:] = list(self.problems), []
        flags = torch.stack(
            [self.first_non_finite, torch.full_like(self.first_non_finite, -len(problems))]
        )
        if is_distributed():
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        step, problem_anywhere = flags.tolist()
        if problem_anywhere:
            raise_together(ValueError(problems[0]) if problems else None)
        if step != _NEVER:
            raise ValueError(
                f"the loss is not finite at step {step + 1} (NaN or Inf in the embeddings "
                "or in the loss: check the learning rate and the inputs)"
            )


def raise_together(error: Exception | None) -> None:
    """Raise on every rank if ``error`` is set on any; the lowest such rank's message wins.

    Every rank must call this at the same point. The messages travel with
    ``all_gather_object``, between this job's own processes.
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else (type(error), str(error)))
    for message in messages:
        if message is not None:
            kind, text = message
            raise kind(text)


def exchange(problem: str | None, value: Any = None) -> tuple[str | None, list[Any]]:
    """Every rank's ``value`` (small, picklable) in rank order, once every rank has reached
    this call, and the lowest rank's ``problem`` (one line) if any rank has one: for the
    steps that every rank takes in turn, such as writing its shards of a checkpoint."""
    reports = [(problem, value)]
    if is_distributed():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (problem, value))
    failed = next((report for report, _ in reports if report is not None), None)
    return failed, [value for _, value in reports]


def on_main_process(fn: Callable[..., T], *args: Any, errors: tuple[type[Exception], ...]) -> T:
    """``fn(*args)`` on the main process only; its ``errors`` are raised on every rank, and
    every rank receives its result (a small picklable value)."""
    result, error = None, None
    if not is_distributed() or dist.get_rank() == 0:
        try:
            result = fn(*args)
        except errors as caught:
            error = caught
    raise_together(error)
    if is_distributed():
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result


def end_process_group() -> None:
    """End the default process group, and every group, if there is one, in a process
    that goes on to other work (the test pool's workers).

    Whatever still holds a group (DDP's reducer, a sync-BatchNorm) is freed first, cycles
    included: torch's gloo aborts the process ("terminate called without an active
    exception") when such an object outlives its group, at exit or at the garbage
    collection that finally frees it, measured on 2-process launches at 5 in 24. (The
    trainer leaves none behind: it ends its group without the collection's 0.2 s.)"""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def settle_before_exit(timeout_s: float = 10.0) -> None:
    """Wait, at most ``timeout_s``, until every rank has reached this call.

    Called on the way out of a failed run, after the rank has printed its error. A
    launcher ends all workers as soon as one exits (torchrun sends SIGTERM): without
    this, a fast rank's exit can cut a slower peer off before it prints its own line.
    It counts arrivals in a key-value store rather than running a collective, so it
    works on any backend and gives up instead of hanging when a peer never comes (it
    stalled, or died): the process group's store, or before there is a group (an
    option refused while parsing) the store that torchrun's agent hosts for its workers.
    """
    try:
        found = _settling_store(timeout_s)
        if found is None:
            return
        store, world_size = found
        store.add(_SETTLE_KEY, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(_SETTLE_KEY, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - best effort: the store may have gone with a peer
        pass


def _settling_store(timeout_s: float) -> tuple[dist.Store, int] | None:
    if is_distributed():
        return default_store(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(
        f"restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    ), world_size


_SETTLE_KEY = "contrastive_accelerate/settle_before_exit"
