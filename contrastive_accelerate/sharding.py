"""``--fsdp``: parameters, gradients and optimizer state sharded over the processes, with
torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), exactly as the replicas train.

Why exactness survives sharding: each rank's loss is its share of the loss of the
global batch (``contrastive_accelerate.collectives``), so the gradient that DDP's
all-reduce averages is the single-process gradient; FSDP2's reduce-scatter averages
the same per-rank gradients and leaves each rank the rows it owns. The gather of the
embeddings does not care how the weights that made them are stored.

- ``shard_model`` shards each block of the towers (a transformer layer, a ResNet
  stage, a ViT block, each tower of a list), then the rest at the root; scalar
  parameters (a learnable logit scale or bias), which FSDP2 cannot shard and the losses
  read outside the forward, stay replicated and their gradients are averaged here.
- ``gradient_sync_deferred``: FSDP2's ``no_sync``, for gradient caching's first K-1
  chunks: one reduce-scatter per optimizer step.
- The evaluation runs on the sharded model: ``shard_model`` registers its
  ``EVALUATION_CALLS`` (``embed``, ...) as forwards, every rank calls them as many
  times (``knn``, ``retrieval``), and ``reshard_after_evaluation`` frees the root's
  gathered weights after.
- ``gathered``: a sharded state's tensors whole, one at a time, and ``read_back``: a
  model's towers filled one at a time from the file they were written to, for
  ``final/`` (``contrastive_accelerate.final_model``): no process holds the whole model.
- ``consolidated``: a plain copy of the model with its full weights, on every rank (the
  trainer no longer needs one; a pipeline that wants the trained model whole may).

A sharded tensor is split along dim 0 as ``torch.chunk`` splits it: rank r holds rows
``[r * c, min((r + 1) * c, n))`` of n, with ``c = ceil(n / W)`` (``local_rows``);
checkpoints store those rows (``contrastive_accelerate.checkpoint_shards``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

#: What ``--mixed_precision`` computes in under ``--fsdp``; gradients are reduced in float32.
PARAMETER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: The methods by which the evaluation calls a model besides ``forward``: FSDP2 gathers
#: the root's own weights around each (``register_fsdp_forward_method``).
EVALUATION_CALLS = ("embed", "project_images", "project_texts")
#: Layer containers whose entries are each one FSDP unit: torchvision's ViT encoder.
_BLOCK_SEQUENCES = ("layers",)
#: torchvision ResNet stages, each one FSDP unit.
_RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``shard_model`` sharded ``model``."""
    return isinstance(model, FSDPModule)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that ``shard_model`` shards each on its own, innermost first: every
    entry of an ``nn.ModuleList`` (transformers' layers, a list of towers), every block
    of torchvision's ViT encoder and every ResNet stage."""
    found: dict[int, tuple[int, nn.Module]] = {}
    for name, module in model.named_modules():
        children: list[nn.Module] = []
        if isinstance(module, nn.ModuleList):
            children = list(module)
        elif isinstance(module, nn.Sequential) and name.rsplit(".", 1)[-1] in _BLOCK_SEQUENCES:
            children = list(module)
        elif all(hasattr(module, stage) for stage in _RESNET_STAGES) and hasattr(module, "fc"):
            children = [getattr(module, stage) for stage in _RESNET_STAGES]
        depth = name.count(".") + 1 if name else 0
        for child in children:
            if next(child.parameters(), None) is not None:
                found[id(child)] = (depth + 1, child)
    return [module for _, module in sorted(found.values(), key=lambda entry: -entry[0])]


def shard_model(
    model: nn.Module, mixed_precision: str = "no", *, trained: bool = True
) -> nn.Module:
    """Shard ``model`` in place over the default process group (FSDP2) and return it.
    Build the optimizer after this call: the parameters are replaced by sharded ones.
    ``trained=False`` (an EMA teacher, which runs no backward): its root reshards after
    each forward too, so that its parameters are the sharded ones between forwards.

    ``mixed_precision`` (Accelerate's ``--mixed_precision``): bf16 or fp16 compute from
    float32 parameters, gradients reduced in float32."""
    # The template holds no weights: each parameter is copied as an empty meta tensor.
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    _TEMPLATES[model] = copy.deepcopy(model, memo)  # what ``read_back``, ``consolidated`` fill
    compute = PARAMETER_DTYPES.get(mixed_precision)
    # Reduced in float32 under mixed precision; else in the parameters' own dtype (float64
    # stays float64).
    policy = MixedPrecisionPolicy(
        param_dtype=compute, reduce_dtype=torch.float32 if compute is not None else None
    )
    replicated = {p for p in model.parameters() if p.dim() == 0}
    for unit in shard_units(model):
        fully_shard(unit, mp_policy=policy, ignored_params=replicated)
    root_reshards = None if trained else True  # None: FSDP2's default, kept for backward
    fully_shard(
        model, mp_policy=policy, ignored_params=replicated, reshard_after_forward=root_reshards
    )
    for name in EVALUATION_CALLS:
        if callable(getattr(model, name, None)):
            register_fsdp_forward_method(model, name)
    _SYNC[model] = sync = _GradientSync(dist.get_world_size())
    for parameter in replicated:
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(sync.average)
    return model


class _GradientSync:
    """The replicated parameters' gradient sync: each accumulation is averaged over the
    ranks (one all-reduce), except under ``gradient_sync_deferred``."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.enabled = world_size, True

    def average(self, parameter: torch.Tensor) -> None:
        if self.enabled:
            parameter.grad.div_(self.world_size)
            dist.all_reduce(parameter.grad)


_SYNC: weakref.WeakKeyDictionary[nn.Module, _GradientSync] = weakref.WeakKeyDictionary()
#: Each sharded model's template: the same module tree, its parameters on the meta device.
_TEMPLATES: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def gradient_sync_deferred(model: nn.Module) -> Iterator[None]:
    """Inside, backward accumulates this rank's gradients unreduced (DDP's ``no_sync``);
    the first backward after it reduces everything accumulated."""
    model.set_requires_gradient_sync(False)
    _SYNC[model].enabled = False
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        _SYNC[model].enabled = True


def local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dim 0 that this rank holds of a sharded tensor."""
    if not isinstance(tensor, DTensor) or tuple(tensor.placements) != (Shard(0),):
        raise ValueError("local_rows takes a tensor sharded along dim 0 over one mesh dimension")
    rows, rank, world_size = (
        tensor.shape[0],
        tensor.device_mesh.get_local_rank(),
        tensor.device_mesh.size(),
    )
    start, stop = shard_rows(rows, world_size)[rank]
    if tensor.to_local().shape[0] != stop - start:
        raise ValueError(f"rank {rank} holds {tensor.to_local().shape[0]} rows, not {stop - start}")
    return start, stop


def shard_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's rows ``[start, stop)`` of a dim of ``rows``, as ``torch.chunk`` splits
    it (FSDP2's layout): ``ceil(rows / world_size)`` each, the last ones fewer or none."""
    size = math.ceil(rows / world_size) if rows else 0
    return [(min(rank * size, rows), min((rank + 1) * size, rows)) for rank in range(world_size)]


@torch.no_grad()
def consolidated(model: nn.Module) -> nn.Module:
    """A plain copy of the sharded ``model`` with its current weights, whole, on every
    rank, to evaluate and save: its template (made by ``shard_model``) filled. Every
    rank must call it; each tensor is all-gathered in turn."""
    state = {
        # A copy each: an unevenly sharded tensor is gathered into a padded buffer.
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in model.state_dict().items()
    }
    template = _TEMPLATES[model]
    template.load_state_dict(state, assign=True)
    return template


def reshard_after_evaluation(model: nn.Module) -> None:
    """After an evaluation's forwards of a sharded ``model``: its root's weights, which
    FSDP2 keeps gathered from a forward until its backward (an evaluation has none),
    freed, so that only the shards stay allocated between evaluations. (The next
    forward gathers the updated weights either way: measured, the figures and weights
    of ``--eval-every 1`` runs are the same without this.)"""
    if is_sharded(model):
        model.reshard()


def gathered(tensors: Mapping[str, torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each of ``tensors`` whole, in turn: a sharded one all-gathered (every rank must
    iterate to the end), so that a writer holds one whole tensor at a time."""
    for value in tensors.values():
        yield (value.full_tensor() if isinstance(value, DTensor) else value).detach()


def unsharded_template(model: nn.Module) -> nn.Module:
    """The sharded ``model``'s module tree as it was before ``shard_model``, its
    parameters on the meta device: what ``read_back`` fills one tower at a time."""
    return _TEMPLATES[model]


def read_back(root: nn.Module, path: str) -> Callable[[nn.Module], AbstractContextManager]:
    """``whole(module)`` for a submodule of ``root`` (an ``unsharded_template``): a
    context inside which ``module`` holds its weights, read from the safetensors file
    at ``path`` that holds ``root``'s state, and outside which they are on the meta
    device again. A model's ``save_exports`` takes it to write one tower at a time."""
    prefixes = {id(module): f"{name}." if name else "" for name, module in root.named_modules()}

    @contextlib.contextmanager
    def whole(module: nn.Module) -> Iterator[nn.Module]:
        names, prefix = list(module.state_dict()), prefixes[id(module)]
        with safe_open(path, framework="pt") as file:
            # A copy of each: the exports may write over the file they were read from.
            state = {name: file.get_tensor(prefix + name).clone() for name in names}
        module.load_state_dict(state, assign=True)
        del state
        try:
            yield module
        finally:
            released = {
                name: torch.empty_like(value, device="meta")
                for name, value in module.state_dict().items()
            }
            module.load_state_dict(released, assign=True)

    return whole
