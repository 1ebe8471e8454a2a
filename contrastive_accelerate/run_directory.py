"""The output directory of one run: its lock, its checkpoints' retention, its final
model and its metrics (``contrastive_accelerate.checkpoint`` writes the checkpoints)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from contrastive_accelerate.checkpoint import (
    FINAL_DIR,
    LOCK_FILE,
    METRICS_FILE,
    CheckpointError,
    RunState,
    complete_checkpoints,
    save_checkpoint,
    save_sharded_checkpoint,
)
from contrastive_accelerate.durable_files import error_reason
from contrastive_accelerate.final_model import save_final_model
from contrastive_accelerate.sharding import is_sharded


class RunDirectory:
    """The output directory of one run: its lock, checkpoints, final model and metrics.

    ``save_checkpoint`` and ``save_final`` write there (call them on the main process, or
    on every rank for a sharded model) and keep only the newest ``keep`` checkpoints
    (None: all).

    ``claim`` (main process) takes the directory's lock, an ``flock`` that the
    operating system drops when the process ends however it ends, so a crashed run
    never leaves it stuck; a second run on the same directory is refused while the
    first lives. A directory holding another run's checkpoints or final model is
    refused unless the run resumes (``--resume-from``) or overwrites it
    (``--overwrite-output-dir``).
    """

    def __init__(self, path: str, keep: int | None = None) -> None:
        self.path, self.keep = path, keep
        self._lock_file = None

    def save_checkpoint(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: RunState,
        method_state: dict[str, torch.Tensor] | None = None,
    ) -> str:
        """``checkpoint-<step>``, written atomically; older ones pruned to ``keep``. Called
        on the main process alone, or for a sharded model (``--fsdp``) on every rank, each
        writing its shards (the main process prunes)."""
        save = save_sharded_checkpoint if is_sharded(model) else save_checkpoint
        path = save(self.path, step, model, optimizer, state, method_state)
        if self.keep and (not dist.is_initialized() or dist.get_rank() == 0):
            self.prune(self.keep)
        return path

    def save_final(self, model, method_state: dict[str, torch.Tensor] | None = None) -> str:
        """The trained model in ``final/`` and the method's state, atomically
        (``contrastive_accelerate.final_model``): on the main process, or for a sharded
        model on every rank."""
        return save_final_model(self.path, model, method_state)

    def claim(self, resume_from: str | None, overwrite: bool) -> str | None:
        """Lock the directory and apply the rules above; returns the checkpoint to resume."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointError(f"--output-dir {self.path!r} is a file, not a directory")
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as error:
            reason = error_reason(error)
            raise CheckpointError(f"cannot create --output-dir {self.path!r}: {reason}") from None
        self._lock()
        try:
            return self._resume_point(resume_from, overwrite)
        except BaseException:  # a refused run must not keep the directory locked
            self.release()
            raise

    def _resume_point(self, resume_from: str | None, overwrite: bool) -> str | None:
        for name in os.listdir(self.path):  # leftovers of a run killed mid-save
            if name.startswith(".") and name.endswith((".partial", ".replaced")):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        checkpoints = complete_checkpoints(self.path)
        final = os.path.join(self.path, FINAL_DIR)
        if resume_from == "latest" and checkpoints:
            return checkpoints[-1]
        if resume_from not in (None, "latest"):
            return resume_from
        if not checkpoints and not os.path.exists(final):
            return None
        if overwrite:
            for path in [*checkpoints, final]:
                shutil.rmtree(path, ignore_errors=True)
            metrics = os.path.join(self.path, METRICS_FILE)
            if os.path.exists(metrics):
                os.remove(metrics)
            return None
        if resume_from == "latest":  # a finished run's final/, no checkpoint: requeued
            raise CheckpointError(
                f"--output-dir {self.path!r} holds a finished run ({FINAL_DIR}, no checkpoint "
                "to continue): it is complete; --overwrite-output-dir trains it again, or "
                "choose another --output-dir"
            )
        found = [os.path.basename(p) for p in checkpoints[-3:]]
        if os.path.exists(final):
            found.append(FINAL_DIR)
        raise CheckpointError(
            f"--output-dir {self.path!r} already holds another run ({', '.join(found)}): "
            "pass --resume-from latest to continue it, --overwrite-output-dir to replace it, "
            "or choose another --output-dir"
        )

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        path = os.path.join(self.path, LOCK_FILE)
        lock_file = open(path, "a+")  # noqa: SIM115 - held open for the run's lifetime
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "unknown"
            lock_file.close()
            raise CheckpointError(
                f"--output-dir {self.path!r} is in use by another run (pid {holder}); "
                "wait for it to finish or choose another --output-dir"
            ) from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._lock_file = lock_file

    def release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the file drops the flock
            self._lock_file = None

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` complete checkpoints."""
        for path in complete_checkpoints(self.path)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def log(self, record: dict[str, Any]) -> None:
        with open(os.path.join(self.path, METRICS_FILE), "a") as file:
            file.write(json.dumps(record) + "\n")
