"""What the trainer's command needs around training: its Accelerator, the launch checks,
and one-line errors with exit codes on every rank.

Exit codes: 0 trained; 2 bad input or a lost peer (one ``error:`` line on every rank
that can still speak); 75 stopped by a signal after a checkpoint
(``contrastive_accelerate.preemption``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import traceback
from collections.abc import Iterator

import torch
import torch.distributed as dist
from accelerate import Accelerator, DistributedType
from accelerate.utils import InitProcessGroupKwargs

from contrastive_accelerate.ranks import settle_before_exit

#: Each process holds a full replica (DDP) or there is one process; ``--fsdp`` shards it
#: over a MULTI_* launch itself (``contrastive_accelerate.sharding``).
SUPPORTED_DISTRIBUTED_TYPES = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
)


class TrainerError(ValueError):
    """A configuration or input problem: reported as one line on every rank."""


def refuse_accelerate_fsdp(accelerator: Accelerator | None = None) -> None:
    """Refuse Accelerate's own FSDP (``--use_fsdp``, an FSDP config file), which on CPU
    processes fails to start or silently falls back to plain multi-CPU: ``--fsdp`` is
    the one sharded path, the same on every backend."""
    requested = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")
    if requested or (accelerator is not None and accelerator.distributed_type == "FSDP"):
        raise TrainerError(
            "Accelerate's FSDP configuration (--use_fsdp, an FSDP config file) is not used by "
            "the trainer: launch without it and pass --fsdp, which shards with FSDP2 the same "
            "way on every backend"
        )


def make_accelerator(
    output_dir: str, report_to: str, collective_timeout: float | None
) -> Accelerator:
    """The Accelerator of a run that brings none: trackers and the collective timeout."""
    refuse_accelerate_fsdp()  # before Accelerate builds its own FSDP plugin
    handlers = []
    if collective_timeout is not None:
        timeout = datetime.timedelta(seconds=collective_timeout)
        handlers.append(InitProcessGroupKwargs(timeout=timeout))
    accelerator = Accelerator(
        # Without an accelerator, Accelerate launched with several processes reports
        # DistributedType.NO unless told to use the CPU: every process would train alone.
        cpu=not torch.accelerator.is_available(),
        log_with=None if report_to == "none" else report_to,
        project_dir=output_dir,
        kwargs_handlers=handlers,
    )
    if accelerator.num_processes == 1 and accelerator.device.type == "cpu":
        use_every_core_unless_told()
    return accelerator


def use_every_core_unless_told() -> None:
    """A lone CPU process computes on every core it may run on, unless the user chose
    its threads. ``accelerate launch`` gives any process it starts ``OMP_NUM_THREADS=1``
    unless the user set that variable (accelerate 1.16, ``commands/launch.py``), which
    leaves all but one core idle; the process cannot tell that default from a user's 1
    except by its launcher's own environment, which on Linux ``/proc`` shows. So the
    threads change only when the parent is ``accelerate launch`` and its environment
    had no ``OMP_NUM_THREADS``; an ``OMP_NUM_THREADS`` the user set is left as it is,
    as are several processes (one thread each is the launcher's sound default there)."""
    if os.environ.get("OMP_NUM_THREADS") != "1" or not hasattr(os, "sched_getaffinity"):
        return
    parent = f"/proc/{os.getppid()}"
    try:
        with open(f"{parent}/cmdline", "rb") as file:
            command = file.read()
        with open(f"{parent}/environ", "rb") as file:
            environment = file.read().split(b"\0")
    except OSError:  # not Linux, or not ours to read: leave the threads as they are
        return
    launched = b"accelerate" in command
    if launched and not any(entry.startswith(b"OMP_NUM_THREADS=") for entry in environment):
        torch.set_num_threads(len(os.sched_getaffinity(0)))


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """The body of a command: bad input (a ``ValueError``, which every rank raises alike)
    and a lost peer become one ``error:`` line and exit code 2; any other error keeps its
    traceback, as a bug should. The process group ends on the way out, whatever happens."""
    try:
        yield
    except (ValueError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and not collective_failure(error):
            raise
        # One write per line: the ranks share the launcher's stderr and must not interleave.
        text = " ".join(str(error).split()) or type(error).__name__
        lost_contact = isinstance(error, RuntimeError)
        if lost_contact:
            text = re.sub(r"^\[[^]]*\]\s*", "", text)  # gloo's source-location prefix
            text = f"lost contact with another process (stalled or died): {text[:200]}"
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"error: {text}\n".encode())
        if not lost_contact:  # a stalled or dead peer would never arrive
            settle_before_exit()
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def collective_failure(error: RuntimeError) -> bool:
    """A collective that timed out or lost its peer. gloo raises plain RuntimeErrors, from
    torch.distributed or from inside DDP's backward; their text names the transport."""
    if isinstance(error, dist.DistError) or re.search(r"gloo|nccl|c10d", str(error), re.I):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return any(f"torch{os.sep}distributed{os.sep}" in frame.filename for frame in frames[-3:])
