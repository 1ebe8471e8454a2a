"""Mixtures (``--dataset`` given several times): every global batch from one source, the
same source on every rank, and the same batches on any number of processes.

- **The source of step t** is drawn from (seed, t) alone: with ``--mixture
  proportional`` by the weights (``--mixture-weights``, or each table's rows to the
  power ``1 / --mixture-temperature``), with ``round-robin`` ``t mod S``. Every rank
  draws the same one, so a global batch never mixes sources, as sentence-transformers'
  samplers and BGE's ``same_dataset_within_batch`` want of a batch, here of the global one.
- **Each source's own sequence of global batches.** Source s's k-th batch is the k-th of
  its own order: a table's from ``GlobalBatchSampler`` (epoch ``k div`` its batches per
  epoch, its permutation from (seed, s, epoch)), a stream's from its streams
  (``data.streams``). k is the number of earlier steps that drew s: a function of t,
  which makes a resume exact on any number of processes, including which source is
  next, with nothing saved.
- **Ranks and workers** as for one source: a table's batch is split into contiguous
  shares, a stream's ranks own whole streams; worker k of a rank builds the steps
  ``(t - first) mod K = k``.

Sources may differ in their columns (one with a hard negative, one without) and size.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from contrastive_accelerate.config import option
from contrastive_accelerate.data.sampler import (
    GlobalBatchSampler,
    batches_per_epoch,
    derive_seed,
)
from contrastive_accelerate.data.sources import DataError
from contrastive_accelerate.data.streams import ShardStreams, stream_batches, worker_share


@dataclass
class MixtureOptions:
    """What only a mixture (several ``--dataset``) reads: this module's options.
    Declared once here, each a ``--flag`` and a config-file key of ``TrainConfig``
    (``contrastive_accelerate.options``), which holds this section."""

    mixture: str = option(
        "proportional", "several --dataset: each global batch from one, by weight or in turn",
        choices=("proportional", "round-robin"),
    )  # fmt: skip
    mixture_weights: str | None = option(
        None, "proportional: weights, one per --dataset; none: by rows (tables)"
    )
    mixture_temperature: float = option(
        1.0, "proportional by rows: weights rows^(1/T); large T: uniform", above=0.0
    )


#: ``derive_seed``'s stream for the source of each step, and for each table's order.
MIXTURE_STREAM = 4


@dataclass
class Mixture:
    """Sources as a method's datasets (``item``, ``collate``, ``problem``; rows a table
    or ``ShardStreams``), their names, and ``weights`` (None: round-robin)."""

    datasets: list[Any]
    names: list[str]
    weights: list[float] | None

    def source_of(self, step: int, seed: int) -> int:
        """The source of global batch ``step``: from (seed, step) alone."""
        if self.weights is None:
            return step % len(self.datasets)
        draws = random.Random(derive_seed(seed, MIXTURE_STREAM, step))
        return draws.choices(range(len(self.datasets)), self.weights)[0]

    def steps_per_source(
        self, steps: int, seed: int, since: tuple[int, list[int]] = (0, [])
    ) -> list[int]:
        """How many of steps ``0 .. steps - 1`` drew each source; ``since``: the counts
        of an earlier number of steps, to count on from."""
        first, counted = since if since[0] <= steps else (0, [])
        counts = collections.Counter(self.source_of(step, seed) for step in range(first, steps))
        return [counts[source] + (counted[source] if counted else 0)
                for source in range(len(self.datasets))]  # fmt: skip


@dataclass
class MixedSources:
    """A mixture's sources (each a loaded table or stream, all of one kind), their
    names and weights (None: round-robin), as ``Mixture`` draws from them; a mixture
    has no held-out rows. ``data.pairs.MixedPairs`` and ``data.images.MixedImages`` add
    what their kind's sources hold."""

    sources: list
    names: list[str]
    weights: list[float] | None
    evaluation = None
    label_column = None

    @property
    def train(self) -> tuple:
        return tuple(source.train for source in self.sources)

    @classmethod
    def of(
        cls, sources: list, names: Sequence[str], mixture: str,
        weights: Sequence[float] | None, temperature: float,
    ):  # fmt: skip
        """``sources``, loaded from ``names``, mixed "round-robin" or "proportional" to
        ``weights`` or to the tables' rows (``mixture_weights``; a stream has none)."""
        if mixture == "round-robin":
            return cls(sources, source_labels(names), None)
        sizes = [None if isinstance(s.train, ShardStreams) else len(s.train) for s in sources]
        return cls(sources, source_labels(names), mixture_weights(sizes, weights, temperature))


def source_labels(names: Sequence[str]) -> list[str]:
    """Each source's name as the logs count its steps: its folder's or file's name, made
    unique with ``#`` and its place."""
    labels = [os.path.basename(os.path.normpath(name)) or name for name in names]
    return [label if labels.count(label) == 1 else f"{label}#{number}"
            for number, label in enumerate(labels)]  # fmt: skip


def mixture_weights(
    sizes: Sequence[int | None], weights: Sequence[float] | None, temperature: float
) -> list[float]:
    """The given ``weights``, or each source's rows to the power ``1 / temperature``
    (1: proportional to size; large: uniform); a stream has no size and needs weights."""
    if weights is not None:
        return list(weights)
    if any(size is None for size in sizes):
        raise DataError("a mixture with a streamed source needs --mixture-weights (no size)")
    return [size ** (1 / temperature) for size in sizes]


class MixtureBatches(torch.utils.data.IterableDataset):
    """This rank's share of every global batch of a ``Mixture`` from ``first_step`` on;
    the loop's sampler (``set_epoch``, ``share_sizes``, ``steps_per_source``).
    ``per_rank_choice``, the negative control: each rank draws its own source (seed +
    rank), so that a global batch mixes sources."""

    def __init__(
        self,
        mixture: Mixture,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        per_rank_choice: bool = False,
    ) -> None:
        self.mixture, self.batch_size, self.seed = mixture, batch_size, seed
        self.rank, self.world_size, self.first_step = rank, world_size, 0
        self.choice_seed = seed + rank if per_rank_choice else seed
        self._counted: tuple[int, list[int]] = (0, [])
        streams = (stream_batches(dataset, batch_size, seed, rank, world_size)
                   for dataset in mixture.datasets)  # fmt: skip
        self.streams = {source: batches for source, batches in enumerate(streams) if batches}

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """A mixture is one epoch: ``start_batch`` is the step to start from."""
        self.first_step = start_batch

    def steps_per_source(self, steps: int) -> dict[str, int]:
        """Each source's steps among the first ``steps``, by name (``steps/NAME``)."""
        names = self.mixture.names
        return {f"steps/{name}": count
                for name, count in zip(names, self._counts(steps), strict=True)}  # fmt: skip

    def _counts(self, steps: int) -> list[int]:
        """``Mixture.steps_per_source``, counted on from the last call's (the loop asks for
        each step in turn: replaying every earlier step each time would be quadratic)."""
        counts = self.mixture.steps_per_source(steps, self.choice_seed, self._counted)
        self._counted = (steps, counts)
        return counts

    def share_sizes(self, step: int) -> list[int]:
        source = self.mixture.source_of(step, self.choice_seed)
        if source in self.streams:
            return self.streams[source].shares
        epoch, batch = divmod(self._counts(step)[source], self._batches_per_epoch(source))
        return self._sampler(source, epoch).share_sizes(batch)

    def _batches_per_epoch(self, source: int) -> int:
        rows = len(self.mixture.datasets[source])
        return batches_per_epoch(rows, self.batch_size, drop_last=False)

    def _sampler(self, source: int, epoch: int) -> GlobalBatchSampler:
        seed = derive_seed(self.seed, MIXTURE_STREAM, source)
        return GlobalBatchSampler(len(self.mixture.datasets[source]), self.batch_size, epoch,
                                  seed, self.rank, self.world_size)  # fmt: skip

    def __iter__(self) -> Iterator[Any]:
        worker, workers = worker_share()
        cursors = self.mixture.steps_per_source(self.first_step, self.choice_seed)
        rows = {source: stream.share_rows(cursors[source])
                for source, stream in self.streams.items()}  # fmt: skip
        orders: dict[tuple[int, int], list] = {}
        for step in itertools.count(self.first_step):
            source = self.mixture.source_of(step, self.choice_seed)
            k, cursors[source] = cursors[source], cursors[source] + 1
            mine = (step - self.first_step) % workers == worker
            if source in self.streams:
                share = next(rows[source])  # read by every worker: the stream's position
                if mine:
                    yield self.streams[source].batch(share)
                continue
            if not mine:
                continue
            epoch, batch = divmod(k, self._batches_per_epoch(source))
            if (source, epoch) not in orders:  # one permutation per table and epoch
                orders = {key: value for key, value in orders.items() if key[0] != source}
                orders[(source, epoch)] = list(self._sampler(source, epoch))
            dataset = self.mixture.datasets[source]
            yield dataset.collate([dataset[item] for item in orders[(source, epoch)][batch]])
