"""Each private API of another library that ``contrastive_accelerate.compat`` uses still
behaves as that entry says; a failure names the entry a new version moved."""

from __future__ import annotations

import multiprocessing

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from contrastive_accelerate import compat
from contrastive_accelerate.testing import COLLECTIVE_TIMEOUT_S, run_on_ranks
from models import SyncBatchNorm


def test_forget_prepared_drops_only_what_was_prepared_since():
    accelerator = Accelerator(cpu=True)
    users = accelerator.prepare(nn.Linear(2, 2))
    count = compat.prepared_count(accelerator)
    accelerator.prepare(nn.Linear(3, 3), torch.optim.SGD(users.parameters(), lr=0.1))
    assert compat.prepared_count(accelerator) == (count[0] + 1, count[1] + 1), "Accelerator._models"
    compat.forget_prepared(accelerator, count)
    assert compat.prepared_count(accelerator) == count


def test_shutdown_workers_ends_persistent_workers():
    before = set(multiprocessing.active_children())  # other tests' process groups, if any
    loader = DataLoader(range(4), batch_size=2, num_workers=1, persistent_workers=True)
    assert len(list(loader)) == 2
    workers = set(multiprocessing.active_children()) - before
    assert workers, "the loader started no worker"
    compat.shutdown_workers(loader)
    assert not any(worker.is_alive() for worker in workers), (
        "DataLoader._iterator._shutdown_workers"
    )


def _store_worker(rank: int, world_size: int) -> int:
    store = compat.default_store()
    store.add("compat-test", rank + 1)
    torch.distributed.barrier()
    return store.add("compat-test", 0)


def test_default_store_is_shared_by_the_group():
    assert run_on_ranks(_store_worker, 2) == [3, 3], "distributed_c10d._get_default_store"


def _timeout_worker(rank: int, world_size: int) -> float:
    return compat.group_timeout().total_seconds()


def test_group_timeout_is_the_one_the_group_was_made_with():
    assert run_on_ranks(_timeout_worker, 2) == [COLLECTIVE_TIMEOUT_S] * 2, "ProcessGroup options"


def test_launcher_accumulation_steps_reads_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    assert compat.launcher_gradient_accumulation_steps() == 3  # pytest is no launcher


def test_dispatch_mode_sees_operators():
    seen = []

    class Recorder(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder():
        torch.ones(2).sum().item()
    assert any("_local_scalar_dense" in name for name in seen), "TorchDispatchMode"


def test_dropout_base_covers_every_dropout():
    layers = [nn.Dropout(), nn.Dropout1d(), nn.Dropout2d(), nn.AlphaDropout()]
    assert all(isinstance(layer, compat.DropoutBase) for layer in layers), "_DropoutNd"


def test_batchnorm_base_covers_every_batchnorm():
    layers = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), SyncBatchNorm(2)]
    assert all(isinstance(layer, compat.BatchNormBase) for layer in layers)
    assert not isinstance(nn.LayerNorm(2), compat.BatchNormBase)


def test_reset_accelerate_state_forgets_the_process_state():
    from accelerate.state import is_initialized

    Accelerator(cpu=True)
    assert is_initialized()
    compat.reset_accelerate_state()
    assert not is_initialized()
