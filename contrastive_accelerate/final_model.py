"""The trained model's ``<output-dir>/final/``: written whole, atomically, and for a
sharded model (``--fsdp``) without any process ever holding more than one tower.

``final/`` holds ``model.safetensors`` (the model's state, as checkpoints name it),
``method.safetensors`` when the method keeps state (a teacher, a queue, a center), and
the model's exports (``save_exports``): a Hugging Face directory per tower, a
sentence-transformers directory, ``config.json``.

A sharded model's state is written tensor by tensor: every rank all-gathers each
tensor in turn (``sharding.gathered``) and the main process appends it to the file
(``durable_files.write_tensors_in_turn``), so that a process holds one whole tensor at
a time. The exports are then written by the main process from the model's unsharded
template, each tower's weights read back from that file inside ``whole(tower)``
(``sharding.read_back``) and released after it: at most one tower is whole at once.
Where a model does not allow it:

- a one-tower image model (``models.SimCLR``) is its tower: it is whole once;
- ``--clip-model``'s transformers model is saved as one model: both towers at once;
- a LoRA-adapted tower is merged on a copy: that tower twice;
- the sentence-transformers export of two towers (a ``Router``) holds both.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil

import torch
from safetensors import SafetensorError

from contrastive_accelerate.checkpoint import FINAL_DIR, METHOD_FILE, MODEL_FILE, CheckpointError
from contrastive_accelerate.collectives import rank_and_world_size
from contrastive_accelerate.durable_files import (
    error_reason,
    fsync_directory,
    write_tensors_in_turn,
)
from contrastive_accelerate.ranks import exchange
from contrastive_accelerate.sharding import gathered, is_sharded, read_back, unsharded_template


def save_final_model(
    output_dir: str, model: torch.nn.Module, method_state: dict[str, torch.Tensor] | None = None
) -> str:
    """The trained ``model`` and the method's state in ``<output_dir>/final``,
    atomically; returns its path. ``model`` has ``save_exports(directory, whole)``
    (``models``). Called on the main process alone, or for a sharded model on every
    rank (each tensor is gathered in turn, the main process writes). A write error
    raises ``CheckpointError`` (on every rank, for a sharded model) and leaves any
    earlier ``final/`` as it was."""
    sharded = is_sharded(model)
    main = not sharded or rank_and_world_size()[0] == 0
    final = os.path.join(output_dir, FINAL_DIR)
    partial = os.path.join(output_dir, f".{FINAL_DIR}.partial")
    problem = None
    if main:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as error:
            problem = error
    for name, state in ((MODEL_FILE, model.state_dict()), (METHOD_FILE, method_state or {})):
        if state:
            problem = _write(os.path.join(partial, name), state, main and not problem) or problem
    if main and not problem:
        try:
            if sharded:  # the towers read back one at a time from the file just written
                template = unsharded_template(model)
                template.save_exports(
                    partial, read_back(template, os.path.join(partial, MODEL_FILE))
                )
            else:
                model.save_exports(partial, contextlib.nullcontext)
            fsync_directory(partial)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
        except (OSError, SafetensorError) as error:
            problem = error
    failed = problem and error_reason(problem)
    if sharded:
        failed, _ = exchange(failed)
    if failed:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"cannot write the final model {final}: {failed}")
    return final


def _write(path: str, state: dict[str, torch.Tensor], write: bool) -> Exception | None:
    """``state`` into the safetensors file ``path``, one whole tensor at a time (only
    when ``write``); returns the write's error. Every rank gathers every tensor, whatever
    happens to the file: the others wait for each gather."""
    tensors = gathered(state)
    try:
        if write:
            specs = {name: (value.dtype, tuple(value.shape)) for name, value in state.items()}
            write_tensors_in_turn(path, specs, tensors)
    except (OSError, ValueError) as error:
        return error
    finally:
        collections.deque(tensors, maxlen=0)  # the tensors a failed write left ungathered
    return None
