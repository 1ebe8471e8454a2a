"""Full-precision islands for losses under mixed precision.

Similarities, log-sum-exp and the loss itself are computed in float32 (float64
stays float64) whatever the input dtype and whether autocast is on: in bfloat16
a similarity of 1/temperature = 10 has a rounding step of 0.06, and exp() of
that error shows up directly in the loss (open_clip PR #158, sentence-transformers
PR #3800). Casting up is differentiable, so the gradient returns to the caller in
the input's own dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


@contextlib.contextmanager
def autocast_off(device: torch.device) -> Iterator[None]:
    """Disable autocast on ``device``'s type, so matmuls keep their inputs' dtype. Nothing
    to do where autocast is off already: under ``torch.compile``, an autocast region that a
    graph break (a collective) cuts in two fails to compile (torch 2.14.1)."""
    if not torch.is_autocast_enabled(device.type):
        yield
        return
    with torch.autocast(device.type, enabled=False):
        yield


class _MatMulWithoutAutocast(torch.autograd.Function):
    """``a @ b`` with autocast off in forward *and* backward.

    forward: ``c = a @ b``;  backward: ``da = g @ b^T``, ``db = a^T @ g``.

    A plain matmul's backward runs inside whatever autocast block ``backward()`` is
    called in, and there autocast computes it in bfloat16. This one keeps float32.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        with autocast_off(a.device):
            return a @ b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        with autocast_off(grad.device):
            grad_a = grad_b = None
            # Each gradient in its input's memory layout (as autograd's mm does): a
            # transposed view's gradient, transposed back, is then contiguous for the
            # layer below (BatchNorm's backward is several times slower otherwise).
            if ctx.needs_input_grad[0]:
                grad_a = grad @ b.T if a.is_contiguous() else (b @ grad.T).T
            if ctx.needs_input_grad[1]:
                grad_b = a.T @ grad if b.is_contiguous() else (grad.T @ a).T
        return grad_a, grad_b


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` computed in the inputs' dtype, forward and backward, even under autocast."""
    return _MatMulWithoutAutocast.apply(a, b)
