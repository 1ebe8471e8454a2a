"""One DataLoader for the whole run: this rank's share of every global batch."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from contrastive_accelerate.compat import shutdown_workers
from contrastive_accelerate.data.interfaces import BatchPlan, StreamDataset, TableDataset
from contrastive_accelerate.data.mixture import Mixture, MixtureBatches
from contrastive_accelerate.data.sampler import GlobalBatchSampler
from contrastive_accelerate.data.streams import stream_batches
from contrastive_accelerate.preemption import ignore_stop_signals


def train_loader(
    dataset: TableDataset | StreamDataset | Mixture,
    accelerator: Accelerator,
    *,
    batch_size: int,
    seed: int,
    drop_last: bool,
    num_workers: int | None,
    padded_batches: bool = False,
    duplicate_keys=None,
    per_rank_streams: bool = False,
) -> tuple[DataLoader, BatchPlan]:
    """This rank's share of every global batch; ``sampler.set_epoch`` picks the epoch and
    the first batch. Its workers persist across epochs (safe: each item's randomness
    depends on its (epoch, index), not on the worker). ``num_workers`` None: one per
    spare core of this process's share of the machine, at most 4. ``padded_batches``:
    Accelerate's own sharding, whose ``even_batches`` pads a short last batch with
    repeated samples (a negative control). ``duplicate_keys``: no global batch holds two
    samples sharing a key (``sampler.without_duplicates``). A dataset of a stream
    (``ShardStreams`` rows, ``dataset.item`` and ``dataset.problem``) is read by
    ``StreamBatches``, the loop's sampler then; ``per_rank_streams``: its control. A
    ``data.mixture.Mixture`` of such datasets is read by ``MixtureBatches``."""
    rank, world_size = accelerator.process_index, accelerator.num_processes
    if num_workers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        num_workers = min(4, max(0, (cores or 1) // local_processes - 1))
    # A mixture and a stream make their own batches (data.mixture, data.streams).
    if isinstance(dataset, Mixture):
        batches = MixtureBatches(dataset, batch_size, seed, rank, world_size)
    else:
        batches = stream_batches(dataset, batch_size, seed, rank, world_size, per_rank_streams)
    if batches is not None:
        loader = DataLoader(batches, batch_size=None, collate_fn=as_built,
                            **_workers(num_workers, accelerator))  # fmt: skip
        return loader, batches
    if padded_batches:  # Accelerate shards whole global batches itself
        rank, world_size = 0, 1
    sampler = GlobalBatchSampler(
        len(dataset), batch_size, 0, seed, rank, world_size, drop_last=drop_last,
        duplicate_keys=duplicate_keys,
    )  # fmt: skip
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=dataset.collate,
        **_workers(num_workers, accelerator),
    )  # fmt: skip
    if padded_batches:
        loader = prepare_data_loader(
            loader,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
            split_batches=True,
            even_batches=True,
        )
    return loader, sampler


def as_built(batch):
    """A ``StreamBatches`` batch as it was collated: DataLoader's default would convert
    its tuples to lists."""
    return batch


def _workers(num_workers: int, accelerator: Accelerator) -> dict:
    return dict(
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=accelerator.device.type == "cuda",
        worker_init_fn=ignore_stop_signals if num_workers else None,
    )


@contextlib.contextmanager
def workers_stopped_on_exit(loader: DataLoader) -> Iterator[None]:
    """Stop the loader's persistent workers when the block ends, by an error too (see
    ``compat.shutdown_workers`` for why they cannot be left to the garbage collector)."""
    try:
        yield
    finally:
        shutdown_workers(loader)
