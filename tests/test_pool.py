"""The session's trainer pool is a fresh process for every run, and each method family
trains under a real ``accelerate launch`` as it does in the pool.

Most trainer runs of the suite go to persistent worker processes (``launch.train_pooled``)
instead of a new ``accelerate launch`` each. That is only sound if a run cannot see what
an earlier run in the same worker left behind, and if the pool's ranks are the
launcher's. Checked here:

- each kind of run (the SimCLR family and the momentum teachers through MoCo; pairs
  through image-text, whose text tower imports transformers inside the run, as text
  pairs' does) once under ``accelerate launch`` on 2 processes, end to end, against the
  same command in the pool;
- MoCo with the most state a worker could carry (float64, random augmentations,
  per-sample dropout, a teacher, a queue, checkpoints) twice in one pool.

Every tensor of every file of ``final/`` equal, 0.0. The control leaks a module-level
counter into the runs and shows that the same comparison catches it.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from contrastive_accelerate.workers import MAX_POOLED_WORKERS, run_in_workers, run_on_ranks

from launch import ENV, REPO, final_files_difference, launch, train_pooled

# SimCLR's path (two views, the mlp, keyed dropout) is MoCo's without its teacher and queue.
FAMILIES = {
    "moco": ["--method", "moco", "--queue-size", "10", "--model", "mlp", "--image-size", "8",
             "--dropout", "0.1", "--dtype", "float64", "--batch-size", "6", "--augment",
             "--lr", "0.1", "--max-steps", "5", "--save-every", "3", "--log-every", "1",
             "--knn-k", "0"],
    "image-text": ["--dtype", "float64", "--batch-size", "6", "--max-steps", "5",
                   "--columns", "image,caption", "--model", "mlp", "--image-size", "8",
                   "--dropout", "0.1", "--knn-k", "0", "--num-workers", "0",
                   "--max-length", "8"],
}  # fmt: skip
#: The session fixtures each family trains on: its dataset, then its text model if any.
DATA = {"moco": ["image_folder"],
        "image-text": ["captioned_images", "tiny_bert"]}  # fmt: skip


@pytest.fixture(scope="module")
def family_args(request):
    """The command line of a family, its data included."""

    def get(family: str) -> list[str]:
        if "tiny_bert" in DATA[family]:
            pytest.importorskip("transformers")
        dataset, *text_model = (request.getfixturevalue(name) for name in DATA[family])
        args = [*FAMILIES[family], "--dataset", dataset]
        return args + (["--text-model", *text_model] if text_model else [])

    return get


@pytest.fixture(scope="module")
def launched(tmp_path_factory, family_args):
    """Each family's run under ``accelerate launch`` on 2 processes, made once."""
    outputs = {}

    def get(family: str):
        if family not in outputs:
            outputs[family] = tmp_path_factory.mktemp(f"launched-{family}")
            result = launch(2, *family_args(family), "--output-dir", str(outputs[family]))
            assert "final model:" in result.stdout
        return outputs[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_a_launched_run_equals_its_pooled_twin(family, family_args, launched, tmp_path):
    train_pooled(2, *family_args(family), "--output-dir", str(tmp_path / "pooled"))
    difference = final_files_difference(launched(family), tmp_path / "pooled")
    print(f"{family}: accelerate launch vs pool, 2 processes: {difference:.1e}")
    assert difference == 0.0


def repeated_difference(run, args: list[str], root) -> float:
    """The difference of the same run made twice, one after the other, in one pool."""
    run(2, *args, "--output-dir", str(root / "first"))
    run(2, *args, "--output-dir", str(root / "second"))
    return final_files_difference(root / "first", root / "second")


def test_a_run_repeated_in_the_pool_equals_a_fresh_process(family_args, launched, tmp_path):
    repeated = repeated_difference(train_pooled, family_args("moco"), tmp_path)
    fresh = final_files_difference(tmp_path / "second", launched("moco"))
    print(f"pooled twice: {repeated:.1e}; the second vs a launched process: {fresh:.1e}")
    assert repeated == 0.0 and fresh == 0.0


#: Never reset between runs: the leak of the control.
_runs_so_far = itertools.count()


def leaky_run(num_processes: int, *args: str):
    """A pooled run whose seed counts the runs made before it, as a module-level counter
    or an unreset generator would leak into a run."""
    return train_pooled(num_processes, *args, "--seed", str(next(_runs_so_far)))


def test_control_a_leaked_counter_is_caught(family_args, tmp_path):
    repeated = repeated_difference(leaky_run, family_args("moco"), tmp_path)
    print(f"leaked counter: pooled twice {repeated:.1e}")
    assert repeated > 1e-3


def _sleep_on_rank_one(rank: int, world_size: int, seconds: float) -> int:
    if rank == 1:
        time.sleep(seconds)
    return rank


def test_a_hung_rank_fails_within_the_timeout_and_the_next_run_gets_fresh_workers(
    family_args, tmp_path
):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no result from ranks \[1\] in 3 s"):
        run_in_workers(_sleep_on_rank_one, 2, 600.0, timeout_s=3)
    waited = time.monotonic() - started
    print(f"a rank hung: failed after {waited:.1f} s (timeout 3 s)")
    assert waited < 30
    # A pooled trainer run that does not finish in time: the same, naming its ranks.
    args = family_args("moco")
    with pytest.raises(TimeoutError, match=r"no result from ranks \[0, 1\] in 2 s"):
        train_pooled(2, *args, "--max-steps", "100000", "--output-dir", str(tmp_path / "hung"),
                     timeout=2)  # fmt: skip
    # Fresh workers serve the next run, on the same world size.
    assert run_in_workers(_sleep_on_rank_one, 2, 0.0) == [0, 1]
    train_pooled(2, *args, "--output-dir", str(tmp_path / "next"))
    assert (tmp_path / "next" / "final" / "model.safetensors").exists()


def _abort_on_rank_one(rank: int, world_size: int, seconds: float) -> int:
    if rank == 1:
        os.abort()  # as a native library's uncaught exception ends a process
    time.sleep(seconds)  # the peer that waits, as in a collective, for the dead rank
    return rank


def test_a_rank_that_dies_in_a_call_fails_it_at_once_naming_the_signal():
    """A worker killed by a signal sends no result: the call says so as soon as it sees
    the process gone, not after its timeout, and the next call gets fresh workers."""
    started = time.monotonic()
    with pytest.raises(ChildProcessError, match=r"rank 1 died in the call \(signal SIGABRT\)"):
        run_in_workers(_abort_on_rank_one, 2, 0.0, timeout_s=300)
    waited = time.monotonic() - started
    print(f"a rank died: failed after {waited:.1f} s (timeout 300 s)")
    assert waited < 60
    assert run_in_workers(_sleep_on_rank_one, 2, 0.0) == [0, 1]


def worker_pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one's own error")
    return os.getpid()


def summed_worker_pid(rank: int, world_size: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return os.getpid(), int(total)


def test_a_check_that_raises_on_a_rank_keeps_its_workers_in_a_new_group():
    """Every rank came back, so no worker is stuck: the next check runs on the same
    processes (no imports again) in a group made anew, and its collectives work."""
    before = [pid for pid, _ in run_on_ranks(summed_worker_pid, 2)]
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_on_ranks(_fail_on_rank_one, 2)
    after = run_on_ranks(summed_worker_pid, 2)
    assert [pid for pid, _ in after] == before
    assert [total for _, total in after] == [3, 3]


#: A session of its own (pytest's pools stay as they are): both kinds of calls on 2
#: workers, then world sizes 1, 2, 3, 4 and 1 in turn, counting the live workers. It
#: prints what it saw and waits to be killed.
POOL_SCRIPT = """
import json, multiprocessing, time
from contrastive_accelerate.workers import run_in_workers, run_on_ranks
from test_pool import worker_pid
shared = run_in_workers(worker_pid, 2)
same = run_on_ranks(worker_pid, 2) == shared == run_in_workers(worker_pid, 2)
most = 0
for world_size in (1, 2, 3, 4, 1):
    assert len(run_on_ranks(worker_pid, world_size)) == world_size
    most = max(most, len(multiprocessing.active_children()))
live = [child.pid for child in multiprocessing.active_children()]
print(json.dumps({"shared": same, "most": most, "live": live}), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def killed_pool_session() -> dict:
    """What ``POOL_SCRIPT`` saw, and when it was killed (SIGKILL: no atexit runs)."""
    session = subprocess.Popen(
        [sys.executable, "-c", POOL_SCRIPT], stdout=subprocess.PIPE, text=True,
        env={**ENV, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )  # fmt: skip
    try:
        seen = json.loads(session.stdout.readline())
    finally:
        session.kill()
        session.wait()
    return {**seen, "killed": time.monotonic()}


def test_checks_and_trainer_runs_share_workers_within_a_budget(killed_pool_session):
    """One set of workers per world size serves both kinds of calls, and the least
    recently used are closed when a new world size would exceed the budget."""
    assert killed_pool_session["shared"]
    print(f"most live workers: {killed_pool_session['most']} (budget {MAX_POOLED_WORKERS})")
    assert killed_pool_session["most"] <= MAX_POOLED_WORKERS


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_exit_when_the_process_that_started_them_is_killed(killed_pool_session):
    """A pytest killed by CI's timeout or the OOM killer must not leave its pools behind."""
    workers, killed = killed_pool_session["live"], killed_pool_session["killed"]
    assert workers
    while not all(_gone(pid) for pid in workers) and time.monotonic() - killed < 60:
        time.sleep(0.5)
    print(f"orphaned workers exited {time.monotonic() - killed:.1f} s after their parent")
    assert all(_gone(pid) for pid in workers)
