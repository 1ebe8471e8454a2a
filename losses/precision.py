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
    """Disable autocast on ``device``'s type, so matmuls keep their inputs' dtype."""
    with torch.autocast(device.type, enabled=False):
        yield
