"""Sharded checkpoints (``--fsdp``): each rank writes the rows it holds, and any number
of processes reads them back, nothing pickled.

A sharded ``checkpoint-<step>/`` holds, besides ``trainer_state.json`` (written last):

- ``model-<r>-of-<W>.safetensors``, ``optimizer-<r>-of-<W>.safetensors`` and
  ``method-<r>-of-<W>.safetensors`` (the method's state: an EMA teacher, sharded as its
  student is, a queue, a center): rank r's rows of each sharded tensor
  (``contrastive_accelerate.sharding.shard_rows``), and in rank 0's files the tensors
  that every rank holds whole (buffers, a logit scale, Adam's step count, a queue);
- ``shards.json``: the layout, in JSON: each tensor's shape and each rank's rows (or
  ``null``: whole, in rank 0's file), and each shard file's content digest, which the
  file carries in its safetensors metadata too.

A reader checks, from the headers alone, that every listed shard is there, that no
other shard file is, and that each carries the digest the layout lists: a shard of
another step or run is refused. It then reads only the rows each tensor needs on this
rank (``ShardedTensors.rows``), so a checkpoint written by W processes resumes on any
number: the rows are the same numbers, re-split.

torch's distributed checkpoint (DCP) writes its ``.metadata`` with pickle: it is not
used, and a ``.metadata`` file found in a checkpoint is never read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from contrastive_accelerate.durable_files import (
    NON_FINITE_ADVICE,
    NonFiniteTensor,
    check_finite,
    content_digest,
)
from contrastive_accelerate.sharding import local_rows, shard_rows
from contrastive_accelerate.untrusted import read_json

SHARDS_FILE = "shards.json"
SHARDS_FORMAT = "contrastive-accelerate-shards/2"  # /1 kept the method state whole
PARTS = ("model", "optimizer", "method")
_SHARD = re.compile(r"(model|optimizer|method)-(\d{5})-of-(\d{5})\.safetensors")


class ShardError(ValueError):
    """A sharded checkpoint that cannot be read whole: one line naming the problem."""


def shard_file(part: str, rank: int, world_size: int) -> str:
    return f"{part}-{rank:05d}-of-{world_size:05d}.safetensors"


def split_local(
    tensors: Mapping[str, torch.Tensor], rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """This rank's share of ``tensors`` (a sharded tensor's local rows; the whole of the
    others on rank 0 only) and the layout of all of them."""
    local, layout = {}, {}
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            rows = shard_rows(tensor.shape[0], tensor.device_mesh.size())
            local_rows(tensor)  # checks this rank holds what the layout says
            local[name] = tensor.to_local()
            layout[name] = {"shape": list(tensor.shape), "rows": [list(r) for r in rows]}
        else:
            if rank == 0:
                local[name] = tensor
            layout[name] = {"shape": list(tensor.shape), "rows": None}
    return local, layout


def layout_document(world_size: int, files: dict[str, str], layouts: dict) -> dict:
    """The contents of ``shards.json``: ``files`` maps each shard to its content digest,
    ``layouts`` each part to ``split_local``'s layout."""
    return {"format": SHARDS_FORMAT, "world_size": world_size, "files": files, "tensors": layouts}


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.exists(os.path.join(path, SHARDS_FILE))


def read_layout(path: str) -> tuple[int, dict[str, str], dict[str, dict[str, dict[str, Any]]]]:
    """Check the shards of the checkpoint at ``path`` against its ``shards.json``; returns
    the number of ranks that wrote it, each shard file's content digest and each part's
    layout. Raises ``ShardError``."""
    try:
        layout = read_json(os.path.join(path, SHARDS_FILE))
    except (OSError, ValueError) as error:
        raise ShardError(f"unreadable {SHARDS_FILE}: {error}") from None
    world_size = layout.get("world_size") if isinstance(layout, dict) else None
    files, tensors = (
        layout.get(k) if isinstance(layout, dict) else None for k in ("files", "tensors")
    )
    if isinstance(layout, dict) and layout.get("format") != SHARDS_FORMAT:
        raise ShardError(
            f"{SHARDS_FILE} has format {layout.get('format')!r}, this trainer reads "
            f"{SHARDS_FORMAT!r}"
        )
    if (
        not isinstance(world_size, int)
        or world_size < 1
        or not isinstance(files, dict)
        or not isinstance(tensors, dict)
        or set(tensors) != set(PARTS)
    ):
        raise ShardError(f"malformed {SHARDS_FILE}")
    present = {name for name in os.listdir(path) if _SHARD.fullmatch(name)}
    if world_size > len(present):  # bounded by the files there before it sizes anything
        raise ShardError(
            f"{SHARDS_FILE} names {world_size} ranks, but the checkpoint holds "
            f"{len(present)} shard files"
        )
    expected = {shard_file(part, rank, world_size) for part in PARTS for rank in range(world_size)}
    if set(files) != expected:
        raise ShardError(f"{SHARDS_FILE} does not list the {world_size} ranks' shards")
    if missing := sorted(expected - present):
        raise ShardError(f"shard {missing[0]} is missing (written by {world_size} processes)")
    if extra := sorted(present - expected):
        raise ShardError(f"unexpected shard {extra[0]} (the checkpoint has {world_size} ranks)")
    for name in sorted(expected):
        try:
            with safe_open(os.path.join(path, name), framework="pt") as shard:
                digest = (shard.metadata() or {}).get("digest")
        except (OSError, SafetensorError) as error:
            raise ShardError(f"shard {name} is unreadable: {error}") from None
        if digest != files[name]:
            raise ShardError(
                f"shard {name} belongs to another checkpoint (another step or run: content "
                f"digest {str(digest)[:12]}, this checkpoint's is {str(files[name])[:12]})"
            )
    for part in PARTS:
        for name, entry in tensors[part].items():
            if not _valid_entry(entry, world_size):
                raise ShardError(f"malformed {SHARDS_FILE} entry for {part} tensor {name!r}")
    return world_size, files, tensors


def _valid_entry(entry: Any, world_size: int) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
        return False
    shape, rows = entry["shape"], entry.get("rows")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        return False
    return rows is None or (
        len(shape) > 0 and rows == [list(r) for r in shard_rows(shape[0], world_size)]
    )


class ShardedTensors(Mapping[str, torch.Tensor]):
    """One part (model, optimizer or method) of a sharded checkpoint, read lazily:
    ``[name]`` reads a tensor whole, ``rows(name, start, stop)`` only rows of it (from
    the shards that hold them); ``under(prefix)`` the tensors named ``prefix...``, as a
    ``ShardedTensors`` without the prefix (the method state's ``teacher.``).

    A shard's content digest is recomputed from its tensors the first time this rank
    reads from it and compared with ``digests`` (``shards.json``'s): a shard whose bytes
    were changed after the save is refused, not only one of another checkpoint. Each
    rank hashes only the shards it reads (its own rows and rank 0's whole tensors)."""

    def __init__(
        self,
        path: str,
        part: str,
        world_size: int,
        layout: dict,
        digests: dict[str, str],
        prefix: str = "",
        verified: set[str] | None = None,
    ) -> None:
        self.path, self.part, self.world_size, self.layout = path, part, world_size, layout
        self.digests, self.prefix = digests, prefix
        self._verified = set() if verified is None else verified  # shared with under()

    def under(self, prefix: str) -> ShardedTensors:
        layout = {
            name[len(prefix) :]: entry
            for name, entry in self.layout.items()
            if name.startswith(prefix)
        }
        return ShardedTensors(self.path, self.part, self.world_size, layout, self.digests,
                              self.prefix + prefix, self._verified)  # fmt: skip

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.rows(name, 0, self.shape(name)[0] if self.shape(name) else None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.layout[name]["shape"])

    def rows(self, name: str, start: int, stop: int | None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (a 0-dim tensor: ``stop`` None)."""
        entry = self.layout[name]
        if entry["rows"] is None:
            whole = self._read(0, name, None)
            return whole if stop is None else whole[start:stop]
        pieces = [
            self._read(rank, name, (max(start, first) - first, min(stop, last) - first))
            for rank, (first, last) in enumerate(entry["rows"])
            if max(start, first) < min(stop, last)
        ]
        if not pieces:  # no rows asked for: an empty slice, of the stored dtype
            return self._read(0, name, (0, 0))
        return torch.cat(pieces)

    def _open(self, rank: int):
        file = shard_file(self.part, rank, self.world_size)
        if file not in self._verified:
            with safe_open(os.path.join(self.path, file), framework="pt") as shard:
                digest = content_digest({name: shard.get_tensor(name) for name in shard.keys()})
            if digest != self.digests[file]:
                raise ShardError(
                    f"shard {file} was changed after it was saved (its content digest is "
                    f"{digest[:12]}, {SHARDS_FILE} lists {self.digests[file][:12]})"
                )
            self._verified.add(file)
        return safe_open(os.path.join(self.path, file), framework="pt")

    def _read(self, rank: int, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        entry, file = self.layout[name], shard_file(self.part, rank, self.world_size)
        name = self.prefix + name  # as the file names it
        expected = list(entry["shape"])
        if entry["rows"] is not None:
            first, last = entry["rows"][rank]
            expected[0] = last - first
        with self._open(rank) as shard:
            if name not in shard.keys():
                raise ShardError(f"{file} lacks {self.part} tensor {name!r}")
            stored = shard.get_slice(name)
            if list(stored.get_shape()) != expected:
                raise ShardError(
                    f"{file}: {self.part} tensor {name!r} has shape {stored.get_shape()}, "
                    f"the layout says {expected}"
                )
            tensor = shard.get_tensor(name) if rows is None else stored[rows[0] : rows[1]]
        try:
            check_finite(name, tensor)  # the rows this rank reads, each read once
        except NonFiniteTensor as error:
            raise ShardError(f"{file}: {self.part} {error} {NON_FINITE_ADVICE}") from None
        return tensor


def stored_under(tensors: Mapping[str, torch.Tensor], prefix: str) -> Mapping[str, torch.Tensor]:
    """The stored tensors named ``prefix...``, without the prefix; a sharded part's read
    lazily still."""
    if isinstance(tensors, ShardedTensors):
        return tensors.under(prefix)
    return {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}


def stored_shape(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Size:
    """A stored tensor's shape, without reading a sharded one."""
    if isinstance(tensors, ShardedTensors):
        return tensors.shape(name)
    return tensors[name].shape


def stored_rows(tensors: Mapping[str, torch.Tensor], name: str, start: int, stop: int):
    """Rows ``[start, stop)`` of a stored tensor, reading only those of a sharded one."""
    if isinstance(tensors, ShardedTensors):
        return tensors.rows(name, start, stop)
    return tensors[name][start:stop]


@torch.no_grad()
def load_local_state(model: torch.nn.Module, stored: Mapping[str, torch.Tensor]) -> None:
    """``stored`` into ``model`` in place: this rank's rows of each sharded tensor, the
    others whole. Raises ``RuntimeError`` as ``load_state_dict`` does."""
    current = model.state_dict()
    if unexpected := sorted(set(stored) - set(current)):
        raise RuntimeError(f"Unexpected key(s) in state_dict: {', '.join(unexpected[:5])}")
    for name in stored:
        tensor = current[name]
        if stored_shape(stored, name) != tensor.shape:
            raise RuntimeError(
                f"size mismatch for {name}: copying a param with shape "
                f"{tuple(stored_shape(stored, name))}, the current model's is {tuple(tensor.shape)}"
            )
        if isinstance(tensor, DTensor):
            tensor.to_local().copy_(stored_rows(stored, name, *local_rows(tensor)))
        else:
            tensor.copy_(stored[name])


def stored_like(stored: Mapping[str, torch.Tensor], key: str, parameter: torch.Tensor):
    """The stored optimizer tensor ``key`` of ``parameter``: sharded as the parameter
    (this rank's rows only) when it is, else whole."""
    if isinstance(parameter, DTensor) and len(stored_shape(stored, key)):
        rows = stored_rows(stored, key, *local_rows(parameter))
        return DTensor.from_local(
            rows.to(parameter.device),
            parameter.device_mesh,
            parameter.placements,
            run_check=False,
            shape=parameter.shape,
            stride=parameter.stride(),
        )
    return stored[key]
