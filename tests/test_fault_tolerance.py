"""Safe to resume, safe to preempt: real launches, real signals, real files.

Preemption is checked in float64 against an uninterrupted run of the same command
line on the same number of processes: the resumed run replays the same data, the
restored optimizer state and the same learning rates, so the difference is 0 (the
tolerance, 1e-12, only allows for a summation order we do not control).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from contrastive_accelerate.checkpoint import (
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
)
from contrastive_accelerate.ckpt_diff import max_abs_diff
from contrastive_accelerate.preemption import EXIT_PREEMPTED, REPEAT_WINDOW_S

from launch import (
    ENV,
    LAUNCH_TIMEOUT_S,
    REPO,
    add_unusual_images,
    finish,
    launch_command,
    logged_steps,
    make_image_folder,
    one_line_errors,
    start,
    train_pooled,
    wait_until,
)

MLP = ["--model", "mlp", "--batch-size", "8", "--knn-k", "0", "--log-every", "1"]
EXACT_SAME_PROCESSES = 1e-12


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint at step 2 (1 process, float32)."""
    output = tmp_path_factory.mktemp("base")
    train_pooled(1, *MLP, "--max-steps", "2", "--save-every", "2", "--output-dir", str(output))
    return output


def _copy_checkpoint(base_run: Path, destination: Path) -> Path:
    shutil.copytree(base_run / "checkpoint-2", destination)
    return destination


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


ACCELERATE_FILES = [
    "custom_checkpoint_0.pkl",
    "random_states_0.pkl",
    "optimizer.bin",
    "scheduler.bin",
    "sampler.bin",
    "pytorch_model.bin",
]


def test_resume_never_unpickles(tmp_path, base_run):
    """Pickle payloads under every file name Accelerate's load_state would unpickle are
    ignored (never read); one in the model file refuses the checkpoint. Neither runs."""
    marker = tmp_path / "payload-ran"
    shared = _copy_checkpoint(base_run, tmp_path / "shared")
    for name in ACCELERATE_FILES:
        (shared / name).write_bytes(pickle.dumps(_Payload(marker)))
    args = [*MLP, "--max-steps", "3"]
    train_pooled(1, *args, "--resume-from", str(shared), "--output-dir", str(tmp_path / "a"))
    assert (tmp_path / "a" / "final" / "model.safetensors").exists()

    crafted = _copy_checkpoint(base_run, tmp_path / "crafted")
    (crafted / "model.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    result = train_pooled(
        2, *args, "--resume-from", str(crafted), "--output-dir", str(tmp_path / "b"), check=False
    )
    one_line_errors(result, "corrupt checkpoint: model.safetensors", 2)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated_weights", "no_state_file", "nan_in_optimizer"])
def test_a_damaged_checkpoint_is_one_line_on_every_rank(tmp_path, base_run, damage):
    """Each refused before a step is trained; a NaN in the optimizer state used to be
    trained on and saved into the next checkpoint, which ``latest`` then named."""
    checkpoint = _copy_checkpoint(base_run, tmp_path / "damaged")
    if damage == "truncated_weights":
        weights = checkpoint / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        expected = "corrupt checkpoint"
    elif damage == "nan_in_optimizer":
        from safetensors.torch import load_file, save_file

        tensors = load_file(checkpoint / "optimizer.safetensors")
        name = sorted(tensors)[0]
        tensors[name].view(-1)[0] = float("nan")
        save_file(tensors, checkpoint / "optimizer.safetensors")
        expected = f"optimizer.safetensors: tensor {name!r} holds a NaN or an infinity"
    else:
        (checkpoint / "trainer_state.json").unlink()
        expected = "incomplete checkpoint"
    result = train_pooled(
        2,
        *MLP,
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--resume-from",
        str(checkpoint),
        "--output-dir",
        str(tmp_path / "again"),
        check=False,
    )
    one_line_errors(result, expected, 2)
    assert not (tmp_path / "again" / "final").exists()
    assert latest_checkpoint(str(tmp_path / "again")) is None


# Preemption: SIGTERM to the whole job, as a scheduler sends it.

PREEMPTIBLE = [*MLP, "--dtype", "float64", "--batch-size", "16", "--max-steps", "60"]


def test_sigterm_saves_the_current_step_and_resume_matches_the_uninterrupted_run(tmp_path):
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    train_pooled(2, *PREEMPTIBLE, "--output-dir", str(straight))

    job = start(2, *PREEMPTIBLE, "--output-dir", str(preempted))
    wait_until(lambda: logged_steps(preempted) >= 3)
    os.killpg(job.pid, signal.SIGTERM)
    stdout, stderr = finish(job)
    checkpoints = complete_checkpoints(str(preempted))
    assert len(checkpoints) == 1, (stdout, stderr)
    step = load_checkpoint(checkpoints[0]).step
    assert 3 <= step < 60
    assert f"stopped by SIGTERM at step {step}: checkpoint {checkpoints[0]}" in stdout
    assert stderr.count("received SIGTERM: stopping after the current step") == 2  # per rank
    assert not (preempted / "final").exists()

    train_pooled(2, *PREEMPTIBLE, "--output-dir", str(preempted), "--resume-from", "latest")
    diff = max_abs_diff(str(straight / "final"), str(preempted / "final"))
    print(f"preempted at step {step} of 60, resumed with latest: max abs diff {diff:.3e}")
    assert diff <= EXACT_SAME_PROCESSES


def _direct(*args: str) -> subprocess.Popen:
    """trainer.py run by Python directly (one process, no launcher): its own exit code."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "trainer.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def test_exit_code_after_a_signal_and_a_second_signal_stops_at_once(tmp_path):
    long_run = [*MLP, "--max-steps", "100000"]
    job = _direct(*long_run, "--output-dir", str(tmp_path / "once"))
    wait_until(lambda: logged_steps(tmp_path / "once") >= 2)
    job.send_signal(signal.SIGINT)
    stdout, _ = job.communicate(timeout=120)
    assert job.returncode == EXIT_PREEMPTED
    assert latest_checkpoint(str(tmp_path / "once")) is not None

    job = _direct(*long_run, "--output-dir", str(tmp_path / "twice"), "--save-every", "1")
    wait_until(lambda: logged_steps(tmp_path / "twice") >= 2)
    job.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # a launcher's forwarded copy: still the same request
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == EXIT_PREEMPTED, stderr
    assert "again" not in stderr


def test_a_signal_before_the_first_step_stops_there_saying_nothing_was_trained(tmp_path):
    """Signals are honoured from the moment the run owns its directory: a SIGTERM while
    the data, the model and the first batch are being made (about half a second here,
    from the run's first record in metrics.jsonl) exits with 75, writes no checkpoint,
    and says so, where the process used to die of the signal."""
    output = tmp_path / "run"
    job = _direct(*MLP, "--max-steps", "100", "--output-dir", str(output))
    metrics = output / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and "start_step" in metrics.read_text(), interval=0.01)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert job.returncode == EXIT_PREEMPTED, stderr[-2000:]
    assert (
        "stopped by SIGTERM before step 1, nothing trained: checkpoint none written; "
        "continue with --resume-from latest"
    ) in stdout, stdout
    assert complete_checkpoints(str(output)) == [] and not (output / "final").exists()


def test_a_signal_during_the_final_evaluation_keeps_the_model_and_the_run_finishes_later(tmp_path):
    """The model is saved before the evaluation (which may fail, or be stopped): a SIGTERM
    once final/ exists, while the kNN and linear probes run on the 1,797 digits (seconds),
    exits with 75 and a checkpoint of the last step; --resume-from latest then evaluates
    the same weights."""
    output = tmp_path / "run"
    run = ["--model", "mlp", "--batch-size", "8", "--max-steps", "2", "--log-every", "1",
           "--num-workers", "0", "--output-dir", str(output)]  # fmt: skip
    job = _direct(*run)
    wait_until(lambda: (output / "final" / "model.safetensors").exists(), interval=0.01)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert job.returncode == EXIT_PREEMPTED, stderr[-2000:]
    assert "holds the trained model, not yet evaluated): checkpoint" in stdout, stdout
    assert load_checkpoint(latest_checkpoint(str(output))).step == 2
    trained = max_abs_diff(str(output / "final"), latest_checkpoint(str(output)))
    assert trained == 0.0  # final/ holds the last step's weights
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert not any("linear_probe_top1" in record for record in records)

    shutil.copytree(output / "final", tmp_path / "final-before")
    resumed = train_pooled(1, *run, "--resume-from", "latest")
    assert "linear probe top-1" in resumed.stdout, resumed.stdout
    assert max_abs_diff(str(tmp_path / "final-before"), str(output / "final")) == 0.0


def test_a_second_signal_during_a_save_leaves_the_last_complete_checkpoint_latest(tmp_path):
    """The second signal, more than a second after the first, ends the process at once,
    here while a checkpoint is being written: the partial directory is all it leaves,
    ``latest`` names a complete checkpoint that loads, and ``--resume-from latest``
    continues and removes the partial. ResNet-50 saved every step (200 MB of weights and
    momentum) on 32 px images (a step of about 4 s here): the first signal comes in step
    2 (after its start, where a stop would be agreed before any save), the second once
    step 2's save has begun and the repeat window has passed."""
    output = tmp_path / "run"
    run = ["--model", "resnet50", "--image-size", "32", "--batch-size", "16", "--knn-k", "0",
           "--max-steps", "1000", "--save-every", "1", "--log-every", "1",
           "--num-workers", "0", "--output-dir", str(output)]  # fmt: skip
    partials = lambda: [p for p in output.iterdir() if p.name.endswith(".partial")]  # noqa: E731
    job = _direct(*run)
    wait_until(lambda: latest_checkpoint(str(output)) is not None, interval=0.001)
    time.sleep(0.2)  # into step 2's forward and backward (its start takes milliseconds)
    job.send_signal(signal.SIGTERM)
    first = time.monotonic()
    wait_until(lambda: (partials() and time.monotonic() - first > REPEAT_WINDOW_S + 0.05)
               or job.poll() is not None, interval=0.001)  # fmt: skip
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert job.returncode == -signal.SIGTERM, stderr[-2000:]
    assert "received SIGTERM again: stopping now, without a checkpoint" in stderr
    assert partials(), "the second signal did not land during a save"
    latest = latest_checkpoint(str(output))
    step = load_checkpoint(latest).step  # complete: it loads
    resumed = train_pooled(1, *run[:-2], "--max-steps", str(step + 1), "--resume-from",
                           "latest", "--output-dir", str(output))  # fmt: skip
    assert f"resumed from {latest} at step {step}" in resumed.stdout
    assert not partials() and (output / "final" / "model.safetensors").exists()


def test_second_signal_after_the_repeat_window_exits_at_once():
    code = (
        "import os, signal, time\n"
        "from contrastive_accelerate.preemption import StopSignals, REPEAT_WINDOW_S\n"
        "with StopSignals() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('requested', stop.requested, flush=True)\n"
        "    time.sleep(REPEAT_WINDOW_S + 0.5)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    print('still running', flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout == "requested SIGTERM\n"
    assert result.returncode == -signal.SIGTERM
    assert "received SIGTERM again: stopping now" in result.stderr


# Crashes during a save, retention, the directory lock and mixed runs.


def test_kill_9_during_saves_leaves_only_loadable_checkpoints(tmp_path):
    """ResNet-18 checkpoints (~90 MB with momentum) take long enough to be cut mid-write."""
    resnet = ["--model", "resnet18", "--batch-size", "4", "--knn-k", "0"]
    output = tmp_path / "run"
    partial_seen = 0
    for offset in (0.05, 0.25, 0.6):
        job = start(
            1,
            *resnet,
            "--max-steps",
            "100000",
            "--save-every",
            "1",
            "--output-dir",
            str(output),
            "--resume-from",
            "latest",
        )
        wait_until(lambda: len(complete_checkpoints(str(output))) >= 1)
        time.sleep(offset)
        os.killpg(job.pid, signal.SIGKILL)
        finish(job)
        partial_seen += any(name.endswith(".partial") for name in os.listdir(output))
        for path in complete_checkpoints(str(output)):
            load_checkpoint(path)  # every directory that looks complete loads
    latest = latest_checkpoint(str(output))
    print(f"3 kills, {partial_seen} of them mid-save; latest complete: {latest}")
    # A killed run leaves neither a stuck lock nor a checkpoint that `latest` cannot load.
    resume_to = str(load_checkpoint(latest).step + 1)
    train_pooled(
        1, *resnet, "--max-steps", resume_to, "--output-dir", str(output), "--resume-from", "latest"
    )
    assert (output / "final" / "model.safetensors").exists()


def test_retention_lock_and_refusal_to_mix_runs(tmp_path):
    output = tmp_path / "run"
    train_pooled(
        1,
        *MLP,
        "--max-steps",
        "5",
        "--save-every",
        "1",
        "--save-total-limit",
        "2",
        "--output-dir",
        str(output),
    )
    assert [Path(p).name for p in complete_checkpoints(str(output))] == [
        "checkpoint-4",
        "checkpoint-5",
    ]
    fresh = train_pooled(2, *MLP, "--max-steps", "5", "--output-dir", str(output), check=False)
    one_line_errors(fresh, "already holds another run (checkpoint-4, checkpoint-5, final)", 2)

    job = start(
        1, *MLP, "--max-steps", "100000", "--output-dir", str(output), "--overwrite-output-dir"
    )
    # The old run's files go (final/ last of them), then the new run logs its first step.
    wait_until(lambda: not (output / "final").exists() and logged_steps(output) >= 1)
    assert complete_checkpoints(str(output)) == []
    second = train_pooled(
        2,
        *MLP,
        "--max-steps",
        "5",
        "--output-dir",
        str(output),
        "--resume-from",
        "latest",
        check=False,
    )
    os.killpg(job.pid, signal.SIGKILL)
    finish(job)
    one_line_errors(second, "is in use by another run", 2)


def test_resume_applies_or_refuses_each_changed_option(tmp_path, base_run):
    output = tmp_path / "run"
    shutil.copytree(base_run, output)
    changed = [
        "--lr",
        "0.1",
        "--momentum",
        "0.5",
        "--weight-decay",
        "0",
        "--warmup-steps",
        "0",
        "--temperature",
        "0.3",
        "--max-steps",
        "4",
    ]
    result = train_pooled(1, *MLP, *changed, "--output-dir", str(output), "--resume-from", "latest")
    for line in [
        "--lr 0.03 -> 0.1",
        "--momentum 0.9 -> 0.5",
        "--weight-decay 0.0005 -> 0.0",
        "--warmup-steps 10 -> 0",
        "--temperature 0.5 -> 0.3",
        "--max-steps 2 -> 4",
    ]:
        assert f"resume: applying {line}" in result.stdout, result.stdout
    # Applied, not just said: step 3 (index 2 of 4) runs at 0.1 * cosine half-way = 0.05.
    records = [json.loads(line) for line in (output / "metrics.jsonl").open()]
    lr_at_step_3 = next(r["lr"] for r in records if r.get("step") == 3)
    assert math.isclose(lr_at_step_3, 0.05)

    refused = train_pooled(
        2,
        *MLP,
        "--max-steps",
        "4",
        "--optimizer",
        "adamw",
        "--image-size",
        "12",
        "--model",
        "resnet18",
        "--output-dir",
        str(tmp_path / "other"),
        "--resume-from",
        str(base_run / "checkpoint-2"),
        check=False,
    )
    errors = one_line_errors(refused, "these must match to continue it", 2)
    for field in (
        "--image-size 8 -> 12",
        "--model 'mlp' -> 'resnet18'",
        "--optimizer 'sgd' -> 'adamw'",
    ):
        assert field in errors[0]


def test_bad_values_give_one_line_on_every_rank(tmp_path, base_run):
    # An option refused before any collective (every bound is checked in test_config) is
    # launched on 2 ranks in test_trainer_momentum; these two fail later, in the run.
    results = {
        "is a file, not a directory": train_pooled(
            2, *MLP, "--output-dir", str(base_run / "metrics.jsonl"), check=False
        ),
        "nothing to train: the checkpoint is at step 2 and the run ends at step 1": train_pooled(
            2,
            *MLP,
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "b"),
            "--resume-from",
            str(base_run / "checkpoint-2"),
            check=False,
        ),
    }
    for expected, result in results.items():
        one_line_errors(result, expected, 2)


def test_disk_full_names_the_path_and_keeps_the_last_checkpoint(tmp_path, base_run):
    output = tmp_path / "run"
    shutil.copytree(base_run, output)
    command = launch_command(
        1,
        REPO / "trainer.py",
        *MLP,
        "--max-steps",
        "4",
        "--save-every",
        "1",
        "--output-dir",
        str(output),
        "--resume-from",
        "latest",
    )

    def small_files() -> None:  # writes past 200 kB fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        preexec_fn=small_files,
    )
    one_line_errors(
        result,
        f"cannot write checkpoint {output / 'checkpoint-3'}: File too large; "
        f"the last complete checkpoint is {output / 'checkpoint-2'}",
        1,
    )
    assert [Path(p).name for p in complete_checkpoints(str(output))] == ["checkpoint-2"]
    assert not [name for name in os.listdir(output) if name.endswith(".partial")]


def test_a_stalled_rank_fails_the_job_after_the_collective_timeout(tmp_path):
    job = start(
        2, *MLP, "--max-steps", "100000", "--collective-timeout", "5", "--output-dir", str(tmp_path)
    )
    wait_until(lambda: logged_steps(tmp_path) >= 2)
    workers = {w.environ().get("RANK"): w for w in psutil.Process(job.pid).children(recursive=True)}
    workers["1"].suspend()  # SIGSTOP: alive, holding its connections, answering nothing
    started = time.monotonic()
    try:
        workers["0"].wait(timeout=120)  # rank 0 gives up after the collective timeout
        waited = time.monotonic() - started
    finally:
        workers["1"].resume()
    _, stderr = finish(job)
    print(f"rank 0 failed {waited:.1f} s after rank 1 stalled (--collective-timeout 5)")
    assert "error: lost contact with another process (stalled or died)" in stderr, stderr
    assert waited < 60


@pytest.fixture(scope="module")
def unusual_images(tmp_path_factory):
    root = tmp_path_factory.mktemp("unusual")
    make_image_folder(root, count=10)
    truncated, rgba = add_unusual_images(root)
    return root, truncated


SKIPPING = [
    "--model",
    "mlp",
    "--dtype",
    "float64",
    "--image-size",
    "12",
    "--batch-size",
    "6",
    "--max-steps",
    "4",
    "--knn-k",
    "0",
]


def test_an_unreadable_image_stops_every_rank_with_its_name(tmp_path, unusual_images):
    root, truncated = unusual_images
    result = train_pooled(
        2, *SKIPPING, "--dataset", str(root), "--output-dir", str(tmp_path), check=False
    )
    one_line_errors(result, f"({truncated}) cannot be read: image file is truncated", 2)


def test_skipped_images_keep_one_and_two_processes_identical(tmp_path, unusual_images):
    root, truncated = unusual_images
    finals = []
    for processes in (1, 2):
        output = tmp_path / str(processes)
        result = train_pooled(
            processes,
            *SKIPPING,
            "--dataset",
            str(root),
            "--skip-bad-images",
            "--output-dir",
            str(output),
        )
        assert "warning: skipping image" in result.stdout and str(truncated) in result.stdout
        finals.append(str(output / "final"))
    diff = max_abs_diff(*finals)
    print(f"--skip-bad-images, 1 vs 2 processes: max abs diff {diff:.3e}")
    assert diff <= 1e-10


def test_a_finished_run_requeued_with_latest_is_refused_naming_its_state(tmp_path):
    """A scheduler that requeues a finished job (``--resume-from latest``, a ``final/`` and
    no checkpoint) gets the run's real state and the real remedy, not the advice to pass
    the flag it passed; the finished run is left as it was."""
    flags = ["--model", "mlp", "--max-steps", "1", "--knn-k", "0", "--output-dir",
             str(tmp_path / "run")]  # fmt: skip
    train_pooled(2, *flags)
    model = (tmp_path / "run" / "final" / "model.safetensors").read_bytes()
    result = train_pooled(2, *flags, "--resume-from", "latest", check=False)
    print(one_line_errors(result, "holds a finished run (final, no checkpoint to continue)", 2))
    assert result.returncode == 2
    assert "--resume-from latest to continue" not in result.stderr
    assert (tmp_path / "run" / "final" / "model.safetensors").read_bytes() == model
