"""Files that are complete once they exist: each flushed to disk before it counts, and
their content digests; the checkpoints' writing blocks."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from safetensors.torch import save_file


def content_digest(tensors: Mapping[str, torch.Tensor], values: Any = None) -> str:
    """The SHA-256 of named tensors (name, dtype, shape and bytes, in name order) and of
    JSON ``values``: what a loaded model or tokenizer is, whatever path it came from."""
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class NonFiniteTensor(ValueError):
    """A tensor to be saved, or read from a file, holds a NaN or an infinity."""


#: What a non-finite value read from a checkpoint means to the user who resumes it.
NON_FINITE_ADVICE = "(a diverged or damaged run): resume from an earlier checkpoint"


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise ``NonFiniteTensor`` naming ``name`` if the floating-point ``tensor`` holds a
    NaN or an infinity. A model that a non-finite value reached trains on NaN from then
    on, so no such state is written or loaded."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    # One reduction pass, nothing the size of the tensor allocated: the extremes are
    # finite exactly when every value is (a NaN propagates into both); far faster on CPU
    # than isfinite(tensor).all() (docs/benchmarks.md, "Checkpoint integrity").
    if not all(torch.isfinite(extreme) for extreme in torch.aminmax(tensor)):
        raise NonFiniteTensor(f"tensor {name!r} holds a NaN or an infinity")


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> str:
    """Write ``tensors``, flushed to disk, with their content digest in the file's
    metadata; returns the digest. A non-finite tensor raises ``NonFiniteTensor`` before
    anything is written."""
    # Copies: safetensors refuses tensors that share memory or are not contiguous.
    copies = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    for name, tensor in copies.items():
        check_finite(name, tensor)
    digest = content_digest(copies)
    save_file(copies, path, metadata={"digest": digest})
    fsync_file(path)
    return digest


#: safetensors' names of the dtypes a model or optimizer state holds.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_tensors_in_turn(
    path: str,
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterable[torch.Tensor],
) -> None:
    """A safetensors file written one tensor at a time, flushed to disk: the header from
    ``specs`` (each name's dtype and shape, in the order the data follows), then each of
    ``tensors`` as it comes, so that the writer never holds more than one of them (a
    sharded model's weights, each gathered in turn). Raises ``ValueError`` when a tensor
    does not match its spec, or holds a NaN or an infinity (``NonFiniteTensor``)."""
    header, offset = {}, 0
    for name, (dtype, shape) in specs.items():
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors does
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for (name, (dtype, shape)), tensor in zip(specs.items(), tensors, strict=True):
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"not {dtype} {tuple(shape)}")  # fmt: skip
            check_finite(name, tensor)
            file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        file.flush()
        os.fsync(file.fileno())


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as file:
        json.dump(value, file, indent=2)
        file.flush()
        os.fsync(file.fileno())


def fsync_file(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(path: str) -> None:
    # A renamed entry survives a power cut only once its directory is synced too.
    try:
        fsync_file(path)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.EISDIR):  # not on every FS
            raise


def error_reason(error: Exception) -> str:
    """An OS or safetensors error in the OS's own words, one line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip() or type(error).__name__
    # safetensors wraps the OS's words: "... I/O error: File too large (os error 27)"
    os_error = re.search(r"I/O error: (.*?) \(os error \d+\)", text)
    return os_error.group(1) if os_error else text.splitlines()[0]
