"""Gradient caching: the gradient of a contrastive loss over a batch larger than memory.

Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup". With ``L(z_1, ..., z_K)`` the loss of the embeddings ``z_k = f_theta(x_k)`` of
K chunks, the chain rule splits the gradient into per-chunk terms:

    dL/dtheta = sum_k (dz_k/dtheta)^T g_k + dL/dtheta|_z,    g_k = dL/dz_k

So: embed every chunk without a graph, take the loss and ``g_k`` on the whole batch,
then re-embed each chunk with a graph and backpropagate ``g_k``: activation memory is
one chunk's, and the gradient is the whole batch's, exactly for models without batch
statistics. Unlike plain gradient accumulation, the loss sees every negative.

Two things make the recompute replay the first pass: randomness keyed by sample
(``models.sample_randomness``: dropout masks do not depend on the chunking or on a
generator's state), and BatchNorm running statistics updated in the first pass only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from contrastive_accelerate.compat import BatchNormBase
from contrastive_accelerate.sharding import gradient_sync_deferred, is_sharded


def cached_backward(
    model: nn.Module,
    chunks: Sequence[Any],
    loss_fn: Callable[[list[torch.Tensor]], torch.Tensor],
    *,
    forward: Callable[[Any], torch.Tensor] | None = None,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> torch.Tensor:
    """Accumulate into ``model``'s ``.grad`` the gradient of ``loss_fn`` over all chunks;
    returns the loss (detached).

    ``forward(chunk)`` embeds one chunk (default: ``model(chunk)``); ``loss_fn`` takes the
    list of every chunk's embeddings. Parameters that ``loss_fn`` uses directly (a
    learnable temperature) must be parameters of ``model``. With a DDP-wrapped ``model``
    the first K-1 backward passes run under ``no_sync``: one gradient all-reduce per
    call; with an FSDP2 (``fully_shard``) ``model``, one reduce-scatter. Pass
    ``backward=accelerator.backward`` for Accelerate's loss scaling. Each
    chunk's forward must replay the first pass: key dropout by sample
    (``models.sample_randomness``) inside ``forward``. With one chunk this is a plain
    forward and backward. Example, in an Accelerate loop::

        chunks = list(zip(view0.tensor_split(4), view1.tensor_split(4)))
        loss = cached_backward(model, chunks, lambda z: criterion(*two_views(z)),
                               forward=lambda c: model(torch.cat(c)), backward=accelerator.backward)
        optimizer.step(); optimizer.zero_grad()
    """
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "cached_backward computes gradients: it was called under torch.no_grad() or "
            "torch.inference_mode(); call it where gradients are enabled"
        )
    forward = forward or model
    if len(chunks) == 1:
        loss = loss_fn([forward(chunks[0])])
        backward(loss)
        return loss.detach()

    # 1. Embed every chunk without a graph; BatchNorm updates its running statistics here.
    with torch.no_grad():
        embeddings = [forward(chunk).detach().requires_grad_() for chunk in chunks]
    # 2. The loss on the whole batch: its gradient for each chunk's embeddings, and for the
    #    parameters the loss uses itself. autograd.grad fills no .grad, so no DDP hook fires.
    loss = loss_fn(embeddings)
    parameters = [p for p in model.parameters() if p.requires_grad]
    gradients = torch.autograd.grad(loss, embeddings + parameters, allow_unused=True)
    chunk_gradients, parameter_gradients = gradients[: len(chunks)], gradients[len(chunks) :]
    direct = [(p, g) for p, g in zip(parameters, parameter_gradients, strict=True) if g is not None]
    # 3. Re-embed each chunk with a graph and backpropagate its cached gradient; the
    #    parameters' direct terms ride with the last chunk, whose backward DDP synchronises.
    with frozen_batchnorm_statistics(model):
        for index, (chunk, gradient) in enumerate(zip(chunks, chunk_gradients, strict=True)):
            last = index == len(chunks) - 1
            with contextlib.nullcontext() if last else _sync_deferred(model):
                surrogate = (forward(chunk) * gradient).sum()
                if last:
                    surrogate = surrogate + sum((p * g).sum() for p, g in direct)
                backward(surrogate)
    return loss.detach()


def _sync_deferred(model: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync``, its FSDP2 equivalent (``--fsdp``), or nothing to defer."""
    if is_sharded(model):
        return gradient_sync_deferred(model)
    return getattr(model, "no_sync", contextlib.nullcontext)()


@contextlib.contextmanager
def frozen_batchnorm_statistics(model: nn.Module):
    """BatchNorm layers normalise with batch statistics, as in training, but leave their
    running statistics alone: the recompute pass must not count a chunk twice."""
    layers = [m for m in model.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
    for layer in layers:
        layer.track_running_stats = False
    try:
        yield
    finally:
        for layer in layers:
            layer.track_running_stats = True


def has_batch_statistics(model: nn.Module) -> bool:
    return any(isinstance(m, BatchNormBase) for m in model.modules())
