"""The global batch, drawn from (seed, epoch) alone, and each rank's contiguous share of it.

The concatenation of the shares in rank order is the single-process batch. The last,
short batch is split without padding (a rank may get nothing), so no sample is
repeated as a false negative.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

#: Independent random streams drawn from the run's seed.
AUGMENT_STREAM, SHUFFLE_STREAM = 0, 1


def derive_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from integers alone (no process state), in about a microsecond."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class GlobalBatchSampler(Sampler[list[tuple[int, int]]]):
    """This rank's share of each global batch of one epoch, as ``(epoch, index)`` items.

    The permutation depends only on (seed, epoch); global batch b is split into
    ``world_size`` contiguous shares of sizes differing by at most one (earlier
    ranks get the extra samples). ``start_batch`` skips batches already trained,
    for an exact mid-epoch resume. ``batch_size`` and ``drop_last`` are there for
    Accelerate's ``BatchSamplerShard``, which only the padded-batches control uses.
    ``duplicate_keys`` (each sample's keys, e.g. its texts' ids): global batches are
    reordered by ``without_duplicates``, from the global batch, so every rank agrees.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        epoch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        start_batch: int = 0,
        duplicate_keys: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.dataset_size, self.global_batch_size = dataset_size, global_batch_size
        self.duplicate_keys = duplicate_keys
        self.epoch, self.seed, self.shuffle, self.drop_last = epoch, seed, shuffle, drop_last
        self.rank, self.world_size, self.start_batch = rank, world_size, start_batch
        self.batch_size = global_batch_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Continue with ``epoch`` from its batch ``start_batch``: one DataLoader, and its
        persistent workers, serve every epoch (items carry their epoch)."""
        self.epoch, self.start_batch = epoch, start_batch

    def global_batches(self) -> list[torch.Tensor]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(
                derive_seed(self.seed, SHUFFLE_STREAM, self.epoch)
            )
            order = torch.randperm(self.dataset_size, generator=generator)
        else:
            order = torch.arange(self.dataset_size)
        count = batches_per_epoch(self.dataset_size, self.global_batch_size, self.drop_last)
        batches = list(order.split(self.global_batch_size)[:count])
        if self.duplicate_keys is not None:
            batches = without_duplicates(batches, order.tolist(), self.duplicate_keys)
        return batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.global_batches()[self.start_batch :]:
            share = batch.tensor_split(self.world_size)[self.rank]
            yield [(self.epoch, index) for index in share.tolist()]

    def share_sizes(self, batch: int) -> list[int]:
        """Every rank's number of samples in global batch ``batch`` of an epoch: what the
        losses would otherwise exchange at every step."""
        length = min(self.global_batch_size, self.dataset_size - batch * self.global_batch_size)
        return share_sizes(length, self.world_size)

    def __len__(self) -> int:
        return max(
            0,
            batches_per_epoch(self.dataset_size, self.global_batch_size, self.drop_last)
            - self.start_batch,
        )


def without_duplicates(
    batches: list[torch.Tensor], order: list[int], keys: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """``batches`` of the same sizes refilled from ``order`` so that no batch holds two
    samples that share a key (a text that would be a false negative), as
    sentence-transformers' ``NoDuplicatesBatchSampler`` does: each batch takes the next
    samples whose keys are new to it, and the ones it skips go first into the next
    batch. Where no such sample is left, a batch is filled with skipped ones anyway
    (the sizes are the epoch's, which resuming relies on)."""
    remaining, refilled = deque(order), []
    for size in (len(batch) for batch in batches):
        batch, seen, skipped = [], set(), []
        while remaining and len(batch) < size:
            index = remaining.popleft()
            if seen.isdisjoint(keys[index]):
                batch.append(index)
                seen.update(keys[index])
            else:
                skipped.append(index)
        unavoidable = size - len(batch)  # duplicates, when nothing else is left
        batch += skipped[:unavoidable]
        remaining.extendleft(reversed(skipped[unavoidable:]))
        refilled.append(torch.tensor(batch, dtype=torch.long))
    return refilled


def share_sizes(global_batch_size: int, world_size: int) -> list[int]:
    """The ranks' shares of a global batch, as ``tensor_split`` makes them: sizes differing
    by at most one, the extra samples on the earlier ranks."""
    base, extra = divmod(global_batch_size, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


def batches_per_epoch(dataset_size: int, global_batch_size: int, drop_last: bool) -> int:
    """Full batches, plus the short last one unless ``drop_last`` or it holds one sample
    (a single pair has no negatives)."""
    remainder = dataset_size % global_batch_size
    return dataset_size // global_batch_size + (not drop_last and remainder >= 2)
