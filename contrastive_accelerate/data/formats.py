"""The file formats a ``--dataset`` may be: one row of ``FORMATS`` per extension, which
says how a file of it is read as a table (the ``datasets`` builder that
``sources.load_image_dataset`` and the pairs' loader call) and how as shards of a
stream (the reader of ``streams.ShardStreams``). A format missing one of the two is
refused there with the formats that have it.

Adding a format, a checklist: its row here; its table builder is a ``datasets``
packaged builder (nothing runs a file's own code), its stream reader a branch of
``streams.ShardStreams``' rows; its tests write a file of it (``tests/launch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FileFormat:
    """How a file of one extension is read: as a table, as shards, or both."""

    #: The ``datasets`` builder that reads it as a table; None: not as a table.
    table: str | None
    #: The ``ShardStreams`` reader that reads it as shards; None: not as a stream.
    stream: str | None


FORMATS: dict[str, FileFormat] = {
    ".parquet": FileFormat(table="parquet", stream="parquet"),
    ".jsonl": FileFormat(table="json", stream="jsonl"),
    ".json": FileFormat(table="json", stream=None),  # one document: no rows to stream
    ".csv": FileFormat(table="csv", stream=None),
    ".tar": FileFormat(table=None, stream="tar"),  # webdataset shards
}
#: Each extension read as a table: its ``datasets`` builder.
TABLE_BUILDERS = {ext: row.table for ext, row in FORMATS.items() if row.table is not None}
#: Each extension read as shards: its ``ShardStreams`` reader.
SHARD_READERS = {ext: row.stream for ext, row in FORMATS.items() if row.stream is not None}
