"""Checkpoints that are safe to load, safe to interrupt, and owned by one run.

A checkpoint ``<output-dir>/checkpoint-<step>/`` holds three or four files:

- ``model.safetensors``: the model's state (weights and BatchNorm running statistics);
- ``optimizer.safetensors``: the optimizer's per-parameter tensors (momentum, Adam moments);
- ``method.safetensors``, when the method keeps state across steps (a queue, a center,
  a teacher): the same on every rank, so a run resumes on any number of processes;
- ``trainer_state.json``: the step, the run's resolved options, the optimizer's
  few non-tensor values, and the content digests of the models and tokenizers the run
  loaded (``inputs``), so that a resume needs the same files, not the same path.

Nothing is pickled, so loading a checkpoint someone else made cannot run code:
safetensors and JSON hold data only. Nothing else needs saving: the learning rate is
a function of the step, and every random draw is a function of (seed, epoch, sample
index), so there is no RNG state to restore.

A checkpoint is written under ``.checkpoint-<step>.partial``, each file flushed to
disk, and renamed when complete: a crash at any moment leaves either the previous
set of complete checkpoints or the new one, never a directory that looks complete
and is not. ``trainer_state.json`` is written last, so a directory without a valid
one is never picked by ``latest_checkpoint``.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from contrastive_accelerate import checkpoint_shards as shards
from contrastive_accelerate.collectives import rank_and_world_size
from contrastive_accelerate.config import flag
from contrastive_accelerate.durable_files import (
    NON_FINITE_ADVICE,
    NonFiniteTensor,
    check_finite,
    error_reason,
    fsync_directory,
    write_json,
    write_tensors,
)
from contrastive_accelerate.ranks import exchange
from contrastive_accelerate.untrusted import read_json

FORMAT = "contrastive-accelerate-checkpoint/1"
MODEL_FILE, OPTIMIZER_FILE, METHOD_FILE, STATE_FILE = (
    "model.safetensors",
    "optimizer.safetensors",
    "method.safetensors",
    "trainer_state.json",
)
METRICS_FILE, LOCK_FILE, FINAL_DIR = "metrics.jsonl", ".lock", "final"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class CheckpointError(ValueError):
    """A checkpoint or output-directory problem: reported as one line naming the path."""


@dataclass
class RunState:
    """What every checkpoint of a run records besides the tensors."""

    config: dict[str, Any]  # the run's resolved options
    train_samples: int
    world_size: int
    #: Content digests of what an option loaded, by option name and part: e.g.
    #: ``{"text_model": {"weights": ..., "tokenizer": ...}}`` (``content_digest``).
    inputs: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass
class Checkpoint:
    """A checkpoint as read from disk: tensors and plain JSON values, nothing executable."""

    path: str
    step: int
    config: dict[str, Any]
    train_samples: int
    #: Read whole, or lazily from a sharded checkpoint (``checkpoint_shards.ShardedTensors``).
    model_state: Mapping[str, torch.Tensor]
    optimizer_tensors: Mapping[str, torch.Tensor]
    optimizer_values: dict[str, Any]
    method_state: Mapping[str, torch.Tensor]  # empty for a method without state
    inputs: dict[str, dict[str, str]]  # empty in a checkpoint older than the digests


def checkpoint_step(path: str) -> int | None:
    match = _CHECKPOINT.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def complete_checkpoints(output_dir: str) -> list[str]:
    """The complete ``checkpoint-<step>`` directories of ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        step = checkpoint_step(path)
        if step is not None and _has_valid_state(path):
            found.append((step, path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str) -> str | None:
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def _has_valid_state(path: str) -> bool:
    try:
        _read_state(path)
    except CheckpointError:
        return False
    return True


def save_checkpoint(
    output_dir: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: RunState,
    method_state: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write ``checkpoint-<step>`` atomically; call on one process. Returns its path.

    On a write error (disk full, permissions) the partial directory is removed and
    ``CheckpointError`` names the path; earlier checkpoints are untouched.
    """
    final, partial = _checkpoint_paths(output_dir, step)
    optimizer_tensors, optimizer_values = flatten_optimizer_state(optimizer.state_dict())
    try:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        write_tensors(os.path.join(partial, MODEL_FILE), trained_state(model))
        write_tensors(os.path.join(partial, OPTIMIZER_FILE), optimizer_tensors)
        _commit(output_dir, step, partial, state, optimizer_values, method_state)
    except (OSError, SafetensorError, NonFiniteTensor) as error:
        _abandon(output_dir, final, partial, error)
    return final


def save_sharded_checkpoint(
    output_dir: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: RunState,
    method_state: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write ``checkpoint-<step>`` of a sharded model (``--fsdp``) atomically; every rank
    calls it and writes its own shards (``contrastive_accelerate.checkpoint_shards``),
    then rank 0 the layout, the method state and ``trainer_state.json``, last. A write
    error on any rank removes the partial directory and raises ``CheckpointError`` on
    every rank; earlier checkpoints are untouched."""
    rank, world_size = rank_and_world_size()
    final, partial = _checkpoint_paths(output_dir, step)
    optimizer_tensors, optimizer_values = flatten_optimizer_state(optimizer.state_dict())
    parts = {"model": trained_state(model), "optimizer": optimizer_tensors,
             "method": method_state or {}}  # fmt: skip

    def agree(problem: Exception | None, written: dict[str, str] | None = None) -> dict:
        """Every rank's shards (name: digest); a problem on any rank abandons the save."""
        failed, reports = exchange(problem and error_reason(problem), written or {})
        if failed is not None:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(_cannot_write(output_dir, final, failed))
        return {name: digest for shards_ in reports for name, digest in shards_.items()}

    problem = None
    if rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as error:
            problem = error
    agree(problem)  # the directory exists before any rank writes into it
    layouts, written = {}, {}
    try:
        for part, tensors in parts.items():
            local, layouts[part] = shards.split_local(tensors, rank)
            name = shards.shard_file(part, rank, world_size)
            written[name] = write_tensors(os.path.join(partial, name), local)
    except (OSError, SafetensorError, NonFiniteTensor) as error:
        problem = error
    files = agree(problem, written)
    if rank == 0:
        try:
            document = shards.layout_document(world_size, files, layouts)
            write_json(os.path.join(partial, shards.SHARDS_FILE), document)
            _commit(output_dir, step, partial, state, optimizer_values, method_state=None)
        except (OSError, SafetensorError, NonFiniteTensor) as error:
            problem = error
    agree(problem)
    return final


def _checkpoint_paths(output_dir: str, step: int) -> tuple[str, str]:
    return (
        os.path.join(output_dir, f"checkpoint-{step}"),
        os.path.join(output_dir, f".checkpoint-{step}.partial"),
    )


def _commit(
    output_dir: str,
    step: int,
    partial: str,
    state: RunState,
    optimizer_values: dict,
    method_state: dict[str, torch.Tensor] | None,
) -> None:
    """Finish ``partial`` (the method state, then ``trainer_state.json``) and rename it
    into place, replacing a checkpoint of the same step."""
    if method_state:
        write_tensors(os.path.join(partial, METHOD_FILE), method_state)
    write_json(
        os.path.join(partial, STATE_FILE),
        {
            "format": FORMAT,
            "step": step,
            "world_size": state.world_size,
            "train_samples": state.train_samples,
            "config": state.config,
            "optimizer": optimizer_values,
            "inputs": state.inputs,
        },
    )
    fsync_directory(partial)
    final = _checkpoint_paths(output_dir, step)[0]
    replaced = None
    if os.path.exists(final):  # the same step saved again (e.g. a resumed run)
        replaced = os.path.join(output_dir, f".checkpoint-{step}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    fsync_directory(output_dir)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)


def _abandon(output_dir: str, final: str, partial: str, error: Exception) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    raise CheckpointError(_cannot_write(output_dir, final, error_reason(error))) from None


def _cannot_write(output_dir: str, final: str, reason: str) -> str:
    previous = latest_checkpoint(output_dir)
    kept = f"; the last complete checkpoint is {previous}" if previous else ""
    return f"cannot write checkpoint {final}: {reason}{kept}"


def load_checkpoint(path: str) -> Checkpoint:
    """Read a checkpoint written by ``save_checkpoint``; raises ``CheckpointError``."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume-from {path!r}: no such checkpoint directory")
    state = _read_state(path)
    if shards.is_sharded_checkpoint(path):  # read lazily: each rank reads the rows it needs
        try:
            world_size, digests, layouts = shards.read_layout(path)
        except shards.ShardError as error:
            raise CheckpointError(f"{path!r}: {error}") from None
        model_state, optimizer_tensors, method_state = (
            shards.ShardedTensors(path, part, world_size, layouts[part], digests)
            for part in shards.PARTS
        )
    else:
        model_state = _read_tensors(path, MODEL_FILE)
        optimizer_tensors = _read_tensors(path, OPTIMIZER_FILE)
        method_state = (
            _read_tensors(path, METHOD_FILE)
            if os.path.exists(os.path.join(path, METHOD_FILE))
            else {}
        )
    return Checkpoint(
        path=path,
        step=state["step"],
        config=state["config"],
        train_samples=state["train_samples"],
        model_state=model_state,
        optimizer_tensors=optimizer_tensors,
        optimizer_values=state["optimizer"],
        method_state=method_state,
        inputs=state.get("inputs", {}),
    )


def _read_state(path: str) -> dict[str, Any]:
    state_file = os.path.join(path, STATE_FILE)
    try:
        state = read_json(state_file)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{path!r}: incomplete checkpoint (no valid {STATE_FILE}: {error_reason(error)})"
        ) from None
    expected = {
        "format": str,
        "step": int,
        "world_size": int,
        "train_samples": int,
        "config": dict,
        "optimizer": dict,
    }
    problems = [
        key
        for key, kind in expected.items()
        if not isinstance(state, dict) or not isinstance(state.get(key), kind)
    ]
    if problems:
        raise CheckpointError(
            f"{path!r}: incomplete checkpoint ({STATE_FILE} lacks {', '.join(problems)})"
        )
    if state["format"] != FORMAT:
        raise CheckpointError(
            f"{path!r}: checkpoint format {state['format']!r}, this trainer reads {FORMAT!r}"
        )
    if state["step"] < 0:
        raise CheckpointError(f"{path!r}: negative step in {STATE_FILE}")
    inputs = state.get("inputs", {})
    if not isinstance(inputs, dict) or not all(
        isinstance(parts, dict) and all(isinstance(v, str) for v in parts.values())
        for parts in inputs.values()
    ):
        raise CheckpointError(f"{path!r}: malformed inputs in {STATE_FILE}")
    return state


def _read_tensors(path: str, name: str) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(os.path.join(path, name))
        for key, tensor in tensors.items():
            check_finite(key, tensor)
    except NonFiniteTensor as error:
        raise CheckpointError(f"{path!r}: {name}: {error} {NON_FINITE_ADVICE}") from None
    except (OSError, SafetensorError) as error:
        raise CheckpointError(
            f"{path!r}: corrupt checkpoint: {name}: {error_reason(error)}"
        ) from None
    return tensors


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of ``model``: its state without the frozen parameters (a
    LoRA run's base weights), which the run loads again from their files, as the
    checkpoint's content digests (``RunState.inputs``) require."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return {name: t for name, t in model.state_dict().items() if name not in frozen}


def load_model_state(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    """Load every tensor, strictly: a missing, extra or reshaped tensor is an error;
    frozen parameters may be left out (``trained_state``)."""
    missing = set(trained_state(model)) - set(checkpoint.model_state)
    try:
        if missing:
            raise RuntimeError(f"Missing key(s) in state_dict: {', '.join(sorted(missing)[:5])}")
        if any(isinstance(t, DTensor) for t in model.state_dict().values()):
            shards.load_local_state(model, checkpoint.model_state)
            return
        incompatible = model.load_state_dict(checkpoint.model_state, strict=False)
        if incompatible.unexpected_keys:
            raise RuntimeError(
                f"Unexpected key(s) in state_dict: {', '.join(incompatible.unexpected_keys[:5])}"
            )
    except shards.ShardError as error:
        raise CheckpointError(f"{checkpoint.path!r}: {error}") from None
    except RuntimeError as error:
        detail = " ".join(str(error).split())[:300]
        raise CheckpointError(
            f"{checkpoint.path!r}: the checkpoint's model does not match this model: {detail}"
        ) from None


def load_optimizer_state(optimizer: torch.optim.Optimizer, checkpoint: Checkpoint) -> None:
    """Restore the per-parameter state; hyperparameters stay those of ``optimizer``.

    Each tensor must belong to an existing parameter and have its shape (scalars such
    as Adam's step count aside), so a mismatched checkpoint fails here, whole.
    """
    params = [param for group in optimizer.param_groups for param in group["params"]]
    saved_groups = checkpoint.optimizer_values.get("param_groups")
    current = optimizer.state_dict()
    if not isinstance(saved_groups, list) or [len(g.get("params", ())) for g in saved_groups] != [
        len(g["params"]) for g in current["param_groups"]
    ]:
        raise CheckpointError(
            f"{checkpoint.path!r}: the optimizer state does not match this model's parameters"
        )
    state: dict[int, dict[str, Any]] = {}
    stored = checkpoint.optimizer_tensors
    for key in stored:
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise CheckpointError(f"{checkpoint.path!r}: unexpected optimizer tensor {key!r}")
        index, name = int(parts[1]), parts[2]
        shape = shards.stored_shape(stored, key)
        if index >= len(params) or (len(shape) and shape != params[index].shape):
            raise CheckpointError(
                f"{checkpoint.path!r}: optimizer tensor {key!r} does not match parameter {index}"
            )
        try:
            state.setdefault(index, {})[name] = shards.stored_like(stored, key, params[index])
        except shards.ShardError as error:
            raise CheckpointError(f"{checkpoint.path!r}: {error}") from None
    values = checkpoint.optimizer_values.get("state", {})
    if not isinstance(values, dict):
        raise CheckpointError(f"{checkpoint.path!r}: malformed optimizer state")
    for index, entries in values.items():
        if not str(index).isdigit() or int(index) >= len(params) or not isinstance(entries, dict):
            raise CheckpointError(f"{checkpoint.path!r}: malformed optimizer state")
        for name, value in entries.items():
            if not isinstance(value, bool | int | float | type(None)):
                raise CheckpointError(f"{checkpoint.path!r}: malformed optimizer value {name!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise CheckpointError(
                    f"{checkpoint.path!r}: optimizer value {name!r} is {value} {NON_FINITE_ADVICE}"
                )
            state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def resume(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: RunState,
    rules: dict[str, str],
    resolve: Callable[[dict[str, Any]], dict[str, Any]] = dict,
) -> tuple[Checkpoint, list[str]]:
    """Load ``path`` into ``model`` and ``optimizer``; returns the checkpoint and the
    option changes it applies, as ``--flag old -> new``.

    Every option that shapes the optimisation was saved with the checkpoint. ``rules``
    gives each option's rule (``contrastive_accelerate.config``): a changed "apply"
    option is applied, a changed "refuse" option is an error, as is another training set.
    ``resolve`` fills the derived defaults of the saved options as this version does
    (an older checkpoint may have left one at None), and the defaults of the options it
    does not hold (added since: its run had them at their default, and a run that sets
    one is refused). An option whose loaded content
    both runs digested (``RunState.inputs``) is compared by content, not by its value:
    the same model by another path continues, a tokenizer changed in place does not.
    """
    checkpoint = load_checkpoint(path)
    try:
        saved = resolve(checkpoint.config)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"--resume-from {path!r}: invalid saved options: {error}") from None
    changed, refused = [], []
    for name, rule in rules.items():
        if rule == "free":
            continue
        if name in checkpoint.inputs and name in state.inputs:
            refused += [
                f"{flag(name)}'s {part} (content digest {digest[:12]} -> "
                f"{state.inputs[name].get(part, 'none')[:12]})"
                for part, digest in checkpoint.inputs[name].items()
                if state.inputs[name].get(part) != digest
            ]
        elif name not in checkpoint.config:  # an option added since: the run it saved had
            if saved[name] != state.config[name]:  # its default, which ``resolve`` fills in
                refused.append(f"{flag(name)} (not in the checkpoint)")
        elif saved[name] != state.config[name]:
            entry = f"{flag(name)} {saved[name]!r} -> {state.config[name]!r}"
            (changed if rule == "apply" else refused).append(entry)
    if refused:
        raise CheckpointError(
            f"--resume-from {path!r}: this run differs from the checkpoint's in "
            f"{'; '.join(refused)}; these must match to continue it"
        )
    if checkpoint.train_samples != state.train_samples:
        raise CheckpointError(
            f"--resume-from {path!r}: the checkpoint's run trained on {checkpoint.train_samples} "
            f"images, this one has {state.train_samples} (the dataset, --eval-holdout or "
            "--knn-k 0 changed what is held out)"
        )
    load_model_state(model, checkpoint)
    load_optimizer_state(optimizer, checkpoint)
    return checkpoint, changed


def flatten_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``optimizer.state_dict()`` into safetensors-ready tensors and JSON values."""
    tensors, values = {}, {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach()
            elif isinstance(value, bool | int | float | type(None)):
                values.setdefault(str(index), {})[name] = value
            else:
                raise TypeError(f"cannot checkpoint optimizer state {name!r} of type {type(value)}")
    groups = [
        {key: list(value) if isinstance(value, tuple) else value for key, value in group.items()}
        for group in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "state": values}
