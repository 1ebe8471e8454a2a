"""Streamed shards (``--streaming``): the same global batches on 1 or N processes, read in
order, never whole.

The design, and why each part is there:

- **Shards.** ``--dataset`` names a folder or a glob of shards of one format: webdataset
  tar files (each sample's members share a key; its columns are the members'
  extensions, ``png``, ``jpg``, ``txt``, ``json``, ``cls``, as ``datasets``' webdataset
  builder names them, and a ``json`` object's fields), jsonl or parquet files, sorted
  by name. Anything else (a hub
  name, a dataset repository's folder) is ``load_dataset(..., streaming=True)``, whose
  shards are its ``shard(num_shards, index)``. Nothing is read with random access, and
  nothing needs the number of rows up front.
- **Streams.** Shard i belongs to stream ``i mod V`` (``--streams V``; default
  ``min(8, shards)``). V is fixed by the data and the option, never by the number of
  processes or loader workers: that is what makes the order theirs alone.
- **Passes.** A stream is an endless sequence of passes over its shards. Pass e reads
  them in an order drawn from (seed, stream, e), through a shuffle buffer of
  ``--shuffle-buffer`` rows drawn from the same seed and emptied at the pass's end. Row
  p of stream v's pass e is sample ``(epoch=e, index=p * V + v)``: its augmentation,
  caption draw and dropout keys come from that id, as a table's come from (epoch, row).
- **Global batches.** Step t takes rows ``[t * n_v, (t + 1) * n_v)`` of stream v's
  sequence of passes, ``n_v`` its share of the global batch (``share_sizes(B, V)``), and
  orders them stream after stream.
- **Ranks.** Rank r owns the contiguous streams ``tensor_split(range(V), W)[r]`` and
  reads only those: its share is its streams' rows, and the shares in rank order are the
  global batch. Shares may be uneven (V not a multiple of W), which the losses allow;
  W > V is refused.
- **Resume.** Step t's rows are a function of t: a resumed run, on any number of
  processes, skips each stream to row ``t * n_v`` by reading, without decoding images.
  No position is saved.
- **Workers.** Loader worker k of a rank builds the steps t with ``(t - first) mod K =
  k``: every worker reads the rank's streams, and decodes only its own steps' rows.
  A DataLoader returns its workers' outputs in turn, which is step order.

A row that cannot be used (a JSON line that is not an object, a sample without one of
its columns, the rest of a truncated tar) keeps its place in the stream and is
reported as ``BadRow``, naming the shard and the member or line: an error on every
rank, or with ``--skip-bad-samples`` left out of its batch and said.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import random
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from contrastive_accelerate.config import option
from contrastive_accelerate.data.formats import SHARD_READERS
from contrastive_accelerate.data.sampler import derive_seed, share_sizes
from contrastive_accelerate.data.sources import DataError, first_line
from contrastive_accelerate.durable_files import content_digest
from contrastive_accelerate.untrusted import parse_json


@dataclass
class StreamOptions:
    """What only streamed shards read (``--streaming``): this module's options. Declared
    once here, each a ``--flag`` and a config-file key of ``TrainConfig``
    (``contrastive_accelerate.options``), which holds this section."""

    streaming: bool = option(
        False, "read --dataset's shards (tar, jsonl, parquet) in order, as streams; --max-steps"
    )
    streams: int | None = option(
        None, "--streaming: shard groups each global batch draws from; none: min(8, shards)",
        at_least=1,
    )  # fmt: skip
    shuffle_buffer: int = option(1000, "--streaming: rows each stream shuffles", at_least=1)
    skip_bad_rows: bool = option(
        False, "--streaming: skip unusable rows (a bad JSON line, a missing member) instead"
    )
    stream_split: str = option(
        "streams", "--streaming: per-rank: webdataset's split_by_node, each rank its shards",
        choices=("streams", "per-rank"),
    )  # fmt: skip


#: Shard formats by file suffix.
#: Tar members by their last extension, as webdataset decodes them (``seg.png`` is an
#: image, ``b.txt`` a text): images stay undecoded bytes, decoded where the sample is used;
#: texts, JSON and integers are read here. Nothing is unpickled (``pyd``, ``pth``, ``pkl``
#: stay bytes), and ``id`` stays bytes too: webdataset's int of a non-numeric id would make
#: every row unusable, although a run rarely reads that column.
IMAGE_MEMBERS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "ppm", "tif", "tiff")
TEXT_MEMBERS = ("txt", "text", "transcript", "caption")
JSON_MEMBERS = ("json", "jsn")
INT_MEMBERS = ("cls", "cls2", "class", "count", "index", "inx")
#: ``derive_seed``'s stream for the shard order and shuffle buffer of a pass.
PASS_STREAM = 3
#: The default number of streams is at most this.
DEFAULT_STREAMS = 8
#: Where each row says where it came from (shard and member or line), for errors.
SOURCE_KEY = "__source__"


class BadRow(DataError):
    """A row of a shard that cannot be used; the message names the shard and the member
    or line."""


@dataclass(frozen=True)
class ShardStreams:
    """The shards of ``--dataset`` and their ``streams``; rows through ``rows``.
    ``hub``: the ``datasets.IterableDataset`` whose shards ``shards`` names, if any."""

    shards: tuple[str, ...]
    format: str
    streams: int
    shuffle_buffer: int
    hub: Any = None

    def read(self, shard: int) -> Iterator[dict | BadRow]:
        """Shard number ``shard``'s rows in order (``read_shard``)."""
        if self.hub is None:
            return read_shard(self.shards[shard], self.format)
        part = self.hub.shard(num_shards=len(self.shards), index=shard, contiguous=True)
        return (
            {**row, SOURCE_KEY: f"{self.shards[shard]}, row {number}"}
            for number, row in enumerate(part)
        )

    def rows(self, stream: int, seed: int) -> Iterator[tuple[int, int, dict | BadRow]]:
        """Stream ``stream``'s rows as ``(epoch, index, row)``, pass after pass, forever."""
        shards = list(range(stream, len(self.shards), self.streams))
        for epoch in itertools.count():
            draws = random.Random(derive_seed(seed, PASS_STREAM, stream, epoch))
            order = draws.sample(shards, len(shards))
            rows = itertools.chain.from_iterable(self.read(shard) for shard in order)
            position = -1
            for position, row in enumerate(shuffled(rows, self.shuffle_buffer, draws)):
                yield epoch, position * self.streams + stream, row
            if position < 0:
                names = ", ".join(self.shards[shard] for shard in shards)
                raise DataError(f"stream {stream} ({names}) holds no rows")

    def first_rows(self, count: int | None = None) -> list[dict]:
        """The usable rows of the first shard (at most ``count``), in file order: what
        start-up can look at (the columns, a scratch vocabulary)."""
        rows = (row for row in self.read(0) if isinstance(row, dict))
        return list(itertools.islice(rows, count))

    def digests(self) -> dict[str, str]:
        """The shards as a resume compares them, without reading them (a stream may be
        terabytes): ``shards``, their names and sizes (a hub dataset's name and shards),
        and for files ``shard times``, their modification times to the nanosecond, which
        every write updates: a shard edited in place at the same size is caught. Not
        caught: an edit whose writer restores the time (``touch -r``); refused, wrongly:
        shards copied without their times (``cp -p`` and ``rsync -a`` keep them)."""
        if self.hub is not None:
            listing = [self.hub.info.dataset_name, self.hub.info.config_name, *self.shards]
            return {"shards": content_digest({}, listing)}
        listing = [(os.path.basename(path), os.path.getsize(path)) for path in self.shards]
        times = [os.stat(path).st_mtime_ns for path in self.shards]
        return {"shards": content_digest({}, listing), "shard times": content_digest({}, times)}


def find_shards(
    dataset: str,
    streams: int | None,
    shuffle_buffer: int,
    *,
    config_name: str | None = None,
    split: str = "train",
) -> ShardStreams:
    """The shards that ``dataset`` names, and their streams: a folder or a glob of shard
    files, sorted; else ``load_dataset(dataset, config_name, split=split,
    streaming=True)``'s shards. A one-line ``DataError`` for none, for mixed or unknown
    formats, or for more streams than shards."""
    if os.path.isdir(dataset):
        paths = [os.path.join(dataset, name) for name in os.listdir(dataset)]
        paths = [path for path in paths if os.path.splitext(path)[1] in SHARD_READERS]
    else:
        paths = [path for path in glob.glob(dataset) if os.path.isfile(path)]
    if not paths and not glob.has_magic(dataset):
        return _with_streams(_hub_shards(dataset, config_name, split, shuffle_buffer), streams)
    if not paths:
        raise DataError(
            f"--streaming --dataset {dataset!r}: no shards found (a folder or a glob of "
            f"{', '.join(SHARD_READERS)} files)"
        )
    if config_name or split != "train":
        raise DataError("--dataset-config and --split apply to a hub dataset, not to shard files")
    formats = {os.path.splitext(path)[1] for path in paths}
    if len(formats) > 1 or not formats <= set(SHARD_READERS):
        raise DataError(
            f"--streaming --dataset {dataset!r}: shards are one format of "
            f"{', '.join(SHARD_READERS)}; found {', '.join(sorted(formats))}"
        )
    source = ShardStreams(tuple(sorted(paths)), SHARD_READERS[formats.pop()], 1, shuffle_buffer)
    return _with_streams(source, streams)


def _hub_shards(
    name: str, config_name: str | None, split: str, shuffle_buffer: int
) -> ShardStreams:
    """``load_dataset(name, config_name, split=split, streaming=True)``, its shards named."""
    import datasets

    from contrastive_accelerate.hub import unreachable_reason

    if not os.path.exists(name) and (reason := unreachable_reason(name, "datasets")):
        raise DataError(f"cannot stream dataset {name!r}: {reason}")
    try:
        hub = datasets.load_dataset(name, config_name, split=split, streaming=True)
    except Exception as error:  # datasets raises many types; the user needs one line
        raise DataError(f"cannot stream dataset {name!r}: {first_line(error)}") from None
    count = hub.num_shards
    shards = tuple(f"{name} (shard {index} of {count})" for index in range(count))
    return ShardStreams(shards, "hub", 1, shuffle_buffer, hub)


def _with_streams(source: ShardStreams, streams: int | None) -> ShardStreams:
    """``source`` with ``streams`` streams (default: one per shard, at most 8)."""
    count = streams or min(DEFAULT_STREAMS, len(source.shards))
    if count > len(source.shards):
        raise DataError(
            f"--streams {count} exceeds the {len(source.shards)} shards of the dataset: a "
            "stream is one shard or more"
        )
    return dataclasses.replace(source, streams=count)


def shuffled(rows: Iterator, size: int, draws: random.Random) -> Iterator:
    """``rows`` through a shuffle buffer of ``size``: each incoming row takes the place of
    one drawn from the buffer, which is emptied in a drawn order at the end."""
    buffer: list = []
    for row in rows:
        if len(buffer) < size:
            buffer.append(row)
            continue
        slot = draws.randrange(size)
        yield buffer[slot]
        buffer[slot] = row
    draws.shuffle(buffer)
    yield from buffer


def read_shard(path: str, format: str) -> Iterator[dict | BadRow]:
    """One shard's rows in file order, each with its ``SOURCE_KEY``; what cannot be read
    is a ``BadRow`` in its place (the rest of a truncated file is one)."""
    return {"tar": _tar_rows, "jsonl": _jsonl_rows, "parquet": _parquet_rows}[format](path)


def _jsonl_rows(path: str) -> Iterator[dict | BadRow]:
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            source = f"{path}, line {number}"
            try:
                row = parse_json(line)
            except ValueError as error:
                yield BadRow(f"{source}: malformed JSON ({error})")
                continue
            if not isinstance(row, dict):
                yield BadRow(f"{source}: a JSON {type(row).__name__}, not an object")
                continue
            yield {**row, SOURCE_KEY: source}


def _parquet_rows(path: str) -> Iterator[dict | BadRow]:
    import pyarrow.parquet as parquet

    number = 0
    try:
        for batch in parquet.ParquetFile(path).iter_batches(batch_size=256):
            for row in batch.to_pylist():
                yield {**row, SOURCE_KEY: f"{path}, row {number}"}
                number += 1
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ...
        yield BadRow(f"{path}: unreadable after row {number} ({first_line(error)})")


def _tar_rows(path: str) -> Iterator[dict | BadRow]:
    """webdataset's convention: consecutive members ``dir/key.ext`` with one key are one
    sample, each extension a column (lower-cased); images stay undecoded bytes. A tar
    cut short (which ``tarfile`` takes for its end when the cut falls between headers)
    ends with a ``BadRow`` in place of its last sample."""
    key, row, member_name, problem = None, {}, None, None
    try:
        with tarfile.open(path, mode="r|") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                member_name = member.name
                directory, name = os.path.split(member.name)
                stem, _, extension = name.partition(".")
                if not extension:
                    continue
                if (directory, stem) != key:
                    if row:
                        yield _with_json_fields(row)
                    key = (directory, stem)
                    row = {SOURCE_KEY: f"{path}, {os.path.join(directory, stem)}"}
                data = archive.extractfile(member).read()
                column = extension.lower()  # the column keeps every extension: "seg.png"
                kind = column.rsplit(".", 1)[-1]  # the last one decides the type
                row[column] = _member_value(kind, data, path, member.name)
        if not _ends_like_a_tar(path):
            problem = "no end-of-archive blocks"
    except (tarfile.TarError, EOFError, OSError) as error:
        problem = first_line(error)
    if problem is not None and member_name is None:
        yield BadRow(f"{path}: not a tar archive, or cut before its first member ({problem})")
    elif problem is not None:
        yield BadRow(f"{path}: truncated or malformed tar after {member_name!r} ({problem})")
    elif row:
        yield _with_json_fields(row)


def _with_json_fields(row: dict) -> dict:
    """A sample whose ``json`` member is an object also has its fields as columns (text
    pairs as json members: ``--columns anchor,positive``); members keep their names."""
    fields = row.get("json")
    return {**fields, **row} if isinstance(fields, dict) else row


def _ends_like_a_tar(path: str) -> bool:
    """Whether the file ends as a tar writer ends it: whole 512-byte blocks, the last two
    of zeros."""
    size = os.path.getsize(path)
    if size % 512 or size < 1024:
        return False
    with open(path, "rb") as file:
        file.seek(size - 1024)
        return not any(file.read())


def _member_value(extension: str, data: bytes, path: str, member: str) -> Any:
    if extension in IMAGE_MEMBERS:
        return {"bytes": data, "path": f"{path}:{member}"}
    try:
        if extension in TEXT_MEMBERS:
            return data.decode("utf-8")
        if extension in JSON_MEMBERS:
            return parse_json(data)
        if extension in INT_MEMBERS:
            return int(data.strip())
    except ValueError as error:
        return BadRow(f"{path}: member {member!r} cannot be read ({first_line(error)})")
    return data


class StreamBatches(torch.utils.data.IterableDataset):
    """This rank's share of every global batch from ``first_step`` on, built by
    ``item(row, epoch, index)`` and ``collate`` (a method's dataset's own); the
    DataLoader's ``sampler`` as the loop sees it (``set_epoch``, ``share_sizes``).

    ``check(row)``: a ``BadRow`` message for a row this method cannot use, else None.
    ``per_rank``, the negative control: the common practice (webdataset's
    ``split_by_node``), each rank reading the shards ``rank::world_size`` as one stream
    shuffled with seed + rank, its rows its share; 1 and N processes then differ.
    """

    def __init__(
        self,
        source: ShardStreams,
        item: Callable[[dict, int, int], Any],
        collate: Callable[[list], Any],
        check: Callable[[dict], str | None],
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        per_rank: bool = False,
    ) -> None:
        self.item, self.collate, self.check = item, collate, check
        self.rank, self.first_step = rank, 0
        if per_rank:
            self.source = per_rank_shards(source, rank, world_size)
            self.seed, self.streams = seed + rank, [0]
            self.shares = share_sizes(batch_size, world_size)
            self.rows_per_stream = [self.shares[rank]]
            return
        if world_size > source.streams:
            raise DataError(
                f"--streams {source.streams} is fewer than the {world_size} processes: each "
                f"process reads whole streams; raise --streams (at most the "
                f"{len(source.shards)} shards)"
            )
        self.source, self.seed = source, seed
        self.rows_per_stream = share_sizes(batch_size, source.streams)
        owned = [part.tolist() for part in torch.arange(source.streams).tensor_split(world_size)]
        self.streams = owned[rank]
        self.shares = [sum(self.rows_per_stream[v] for v in streams) for streams in owned]

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """A stream is one epoch: the loop's ``start_batch`` is the step to start from.
        Called before the DataLoader starts its workers, which copy it."""
        self.first_step = start_batch

    def share_sizes(self, step: int) -> list[int]:
        """Every rank's rows in each global batch: its streams' shares."""
        return self.shares

    def __iter__(self) -> Iterator[Any]:
        worker, workers = worker_share()
        for step, rows in enumerate(self.share_rows(self.first_step), self.first_step):
            if (step - self.first_step) % workers == worker:
                yield self.batch(rows)

    def share_rows(self, first_batch: int) -> Iterator[list[tuple[int, int, dict | BadRow]]]:
        """This rank's rows of global batch ``first_batch``, then of each next one."""
        counts = [self.rows_per_stream[v] for v in self.streams]
        readers = [
            itertools.islice(self.source.rows(v, self.seed), first_batch * count, None)
            for v, count in zip(self.streams, counts, strict=True)
        ]
        while True:
            yield [
                row
                for reader, count in zip(readers, counts, strict=True)
                for row in itertools.islice(reader, count)
            ]

    def batch(self, rows: Sequence[tuple[int, int, dict | BadRow]]) -> Any:
        """The collated rows that can be used; the others in its ``unreadable``."""
        items, bad = [], []
        for epoch, index, row in rows:
            if isinstance(row, BadRow):
                problem = str(row)
            else:  # a member that could not be read, or what the method cannot use
                broken = [str(value) for value in row.values() if isinstance(value, BadRow)]
                problem = broken[0] if broken else self.check(row)
            if problem is None:
                items.append(self.item(row, epoch, index))
            else:
                bad.append(BadRow(problem))
        batch = self.collate(items)
        return batch._replace(unreadable=[*batch.unreadable, *bad]) if bad else batch


def stream_batches(
    dataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
    per_rank: bool = False,
) -> StreamBatches | None:  # fmt: skip
    """A method's dataset whose rows are a stream (``dataset.dataset``, a ``ShardStreams``)
    as its ``StreamBatches``; None for a table."""
    source = getattr(dataset, "dataset", None)
    if not isinstance(source, ShardStreams):
        return None
    return StreamBatches(source, dataset.item, dataset.collate, dataset.problem, batch_size,
                         seed, rank, world_size, per_rank)  # fmt: skip


def worker_share() -> tuple[int, int]:
    """(this loader worker's number, the number of workers): (0, 1) without workers."""
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


def per_rank_shards(source: ShardStreams, rank: int, world_size: int) -> ShardStreams:
    """The control's source: shards ``rank::world_size`` as one stream (a hub dataset's
    through ``shard`` again)."""
    if source.hub is None:
        return ShardStreams(source.shards[rank::world_size], source.format, 1,
                            source.shuffle_buffer)  # fmt: skip
    part = source.hub.shard(num_shards=world_size, index=rank, contiguous=False)
    return ShardStreams((f"{source.shards[0]} rank {rank}",), "hub", 1, source.shuffle_buffer,
                        part)  # fmt: skip


def described(train) -> tuple[int, dict[str, dict[str, str]]]:
    """What a resume compares of the training data: a table's number of rows; a stream's
    shards (``RunState.inputs``), its length being unknown; a mixture's (a tuple), each
    source's."""
    if isinstance(train, ShardStreams):
        return 0, {"dataset": train.digests()}
    if isinstance(train, tuple):  # a mixture's sources
        digests = {}
        for number, source in enumerate(train):
            rows, inputs = described(source)
            parts = inputs["dataset"] if inputs else {"shards": str(rows)}
            # "source 0" is the shards' (a table's rows), as before the shard times.
            digests |= {f"source {number}" + ("" if part == "shards" else f" {part}"): digest
                        for part, digest in parts.items()}  # fmt: skip
        return 0, {"dataset": digests}
    return len(train), {}
