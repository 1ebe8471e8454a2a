"""The private APIs of other libraries that this project uses, each in one place.

Every entry says why no public API does the job and the versions it was checked on;
``tests/test_compat.py`` fails loudly, naming the entry, when a version moves one.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    import accelerate

#: Sees every operator that runs (torch 2.4 - 2.14.1), which is how the tests count the host
#: reads of a step; torch exports it from a private module only.
TorchDispatchMode = TorchDispatchMode

#: The base class of every dropout module (torch 2.4 - 2.14.1), channel dropout included.
DropoutBase = nn.modules.dropout._DropoutNd

#: The base class of every BatchNorm{1,2,3}d and SyncBatchNorm (torch 2.4 - 2.14.1): the
#: one type that says "this layer normalises with batch statistics".
BatchNormBase = nn.modules.batchnorm._BatchNorm


def prepared_count(accelerator: accelerate.Accelerator) -> tuple[int, int]:
    """How many models and optimizers ``accelerator`` holds now (see ``forget_prepared``)."""
    return len(accelerator._models), len(accelerator._optimizers)


def forget_prepared(accelerator: accelerate.Accelerator, count: tuple[int, int]) -> None:
    """Drop the models and optimizers prepared since ``prepared_count`` gave ``count``.

    Accelerate keeps a reference to everything it prepares, so a pipeline that calls
    ``train()`` again with the same accelerator would keep each run's model alive.
    Its public ``free_memory()`` drops the user's own objects too. Accelerate 1.0 - 1.15.
    """
    del accelerator._models[count[0] :], accelerator._optimizers[count[1] :]


def reset_accelerate_state() -> None:
    """Forget Accelerate's process state (Accelerate 1.0 - 1.16), as a new process has none.

    Accelerate keeps it in class-level singletons that no public call clears; its own
    tests reset them this way between runs. The test pool's workers run one launched
    process's trainer after another, and need each to start as a new process would."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


def shutdown_workers(loader: DataLoader) -> None:
    """Stop a DataLoader's persistent workers now (torch 2.4 - 2.14.1).

    They ignore SIGTERM (preemption is the main process's to handle), so the SIGTERM
    with which multiprocessing ends daemonic children at exit would leave the
    interpreter waiting for them, while an error's traceback keeps the loader alive.
    DataLoader has no public way to end its workers before it is garbage collected.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def default_store() -> dist.Store:
    """The default process group's key-value store (torch 2.4 - 2.14.1): reachable when a
    peer has died, unlike any collective, so a failing rank can wait for the others with
    a deadline. torch has no public accessor for the store it rendezvoused with."""
    return dist.distributed_c10d._get_default_store()


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The collective timeout that ``group`` (default: the default group) was made with
    (torch 2.4 - 2.14.1), for a side group that must give up as soon as the run's own
    collectives do; None where torch does not expose it."""
    group = group or dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def launcher_gradient_accumulation_steps() -> int:
    """``accelerate launch --gradient_accumulation_steps N`` as the launcher was given it.

    Accelerate (1.0 - 1.15) passes the option on to the script only for DeepSpeed and
    otherwise drops it without a word; the trainer must refuse it (each micro-batch
    would see only its own negatives), not ignore it. The launcher's command line, read
    from ``/proc/<parent>/cmdline`` (Linux), is the only place it survives. Elsewhere,
    or under another launcher, only the environment variable counts.
    """
    steps = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1") or 1)
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as file:
            arguments = file.read().decode(errors="replace").split("\0")
    except OSError:
        return steps
    if not any(
        argument.endswith(("accelerate", "accelerate.commands.launch", "launch"))
        for argument in arguments[:3]
    ):
        return steps
    for index, argument in enumerate(arguments):
        if argument.endswith(".py"):
            break  # the training script: what follows are its own flags
        name, _, value = argument.partition("=")
        if name in ("--gradient_accumulation_steps", "--gradient-accumulation-steps"):
            value = value or (arguments[index + 1] if index + 1 < len(arguments) else "1")
            steps = max(steps, int(value) if value.isdigit() else 1)
    return steps
