"""Activation checkpointing that recomputes exactly what the forward computed.

A checkpointed block runs again in backward, which can change a run two ways: its
dropout would draw new masks (the recompute runs outside the forward's
``sample_randomness`` block), and its BatchNorm layers would update their running
statistics a second time. ``keyed_recompute`` re-enters the forward's sample keys, and
``CheckpointedSequential`` keeps the running statistics during the recompute, so a
checkpointed model trains as the plain one does, on any number of processes.

    model.encoder.layer1 = checkpoint_blocks(model.encoder.layer1)    # a ResNet stage
    checkpoint_transformer_layers(bert)                               # a transformers model
    checkpoint_timm_blocks(timm_vit)                                  # a timm model
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from contrastive_accelerate.compat import BatchNormBase
from models.dropout import keyed_recompute


class CheckpointedSequential(nn.Sequential):
    """``nn.Sequential`` whose blocks are each recomputed in backward (non-reentrant) when
    training with gradients; its children and state keep their names. The recompute
    draws the forward's per-sample masks and leaves BatchNorm's running statistics as
    the forward left them. ``keep_statistics=False`` is the negative control: the
    recompute updates them a second time."""

    def __init__(self, blocks: OrderedDict, keep_statistics: bool = True) -> None:
        super().__init__(blocks)
        self.keep_statistics = keep_statistics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(x)
        for block in self:
            contexts = partial(_block_recompute, block, self.keep_statistics)
            x = checkpoint(block, x, use_reentrant=False, context_fn=contexts)
        return x


def checkpoint_blocks(
    blocks: nn.Sequential, keep_statistics: bool = True
) -> CheckpointedSequential:
    """``blocks`` (a ResNet stage, a ViT's encoder layers) with each block checkpointed."""
    return CheckpointedSequential(OrderedDict(blocks.named_children()), keep_statistics)


def checkpoint_image_encoder(encoder: nn.Module, keep_statistics: bool = True) -> None:
    """Checkpoint each block of a torchvision ResNet (the blocks of its four stages) or
    ViT (its encoder layers), in place. Raises ``ValueError`` for another encoder."""
    layers = getattr(getattr(encoder, "encoder", None), "layers", None)
    if isinstance(layers, nn.Sequential):
        encoder.encoder.layers = checkpoint_blocks(layers, keep_statistics)
        return
    stages = [name for name in ("layer1", "layer2", "layer3", "layer4") if hasattr(encoder, name)]
    if not stages:
        raise ValueError(f"{type(encoder).__name__} has no blocks to checkpoint")
    for name in stages:
        setattr(encoder, name, checkpoint_blocks(getattr(encoder, name), keep_statistics))


def checkpoint_timm_blocks(model: nn.Module, keep_statistics: bool = True) -> None:
    """Checkpoint each block of a timm model, in place, as ``checkpoint_blocks`` does
    (timm's own ``set_grad_checkpointing`` would recompute outside the forward's sample
    keys): a ViT's ``blocks``, each stage's ``blocks`` of a ConvNeXt-like model, an
    EfficientNet's stages, a ResNet's (``checkpoint_image_encoder``). Raises
    ``ValueError`` for another model."""
    if isinstance(getattr(model, "blocks", None), nn.Sequential):
        model.blocks = checkpoint_blocks(model.blocks, keep_statistics)
        return
    stages = getattr(model, "stages", None)
    if isinstance(stages, nn.Sequential) and all(
        isinstance(getattr(stage, "blocks", None), nn.Sequential) for stage in stages
    ):
        for stage in stages:
            stage.blocks = checkpoint_blocks(stage.blocks, keep_statistics)
        return
    checkpoint_image_encoder(model, keep_statistics)


def checkpoint_transformer_layers(encoder: nn.Module) -> None:
    """Activation checkpointing for each layer of a ``transformers`` model, non-reentrant
    and with ``keyed_recompute``: the recompute draws the forward's per-sample masks.
    Raises ``ValueError`` for a model that does not support it."""
    kwargs = {"use_reentrant": False, "context_fn": keyed_recompute}
    enable = getattr(encoder, "activation_checkpointing_enable", None)  # transformers 5
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _block_recompute(
    block: nn.Module, keep_statistics: bool
) -> tuple[AbstractContextManager, AbstractContextManager]:
    forward, recompute = keyed_recompute()
    if not keep_statistics:
        return forward, recompute
    return forward, _stacked(recompute, running_statistics_kept(block))


@contextmanager
def _stacked(*contexts: AbstractContextManager) -> Iterator[None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


@contextmanager
def running_statistics_kept(module: nn.Module) -> Iterator[None]:
    """Inside, ``module``'s BatchNorm layers normalise with batch statistics as in training
    but leave their running statistics and batch count as they were: momentum 0 keeps
    ``running * 1 + batch * 0``, exactly the running value, and the count is put back."""
    layers = [m for m in module.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in layers]
    for layer in layers:
        layer.momentum = 0.0
    try:
        yield
    finally:
        for layer, (momentum, count) in zip(layers, saved, strict=True):
            layer.momentum = momentum
            layer.num_batches_tracked.copy_(count)
