"""trainer.py under real ``accelerate launch``: 1 vs 2 processes, resume, bad input.

Model: ``--model mlp --no-augment`` (no BatchNorm, no random views), the setting in
which world-size invariance depends on the gather and the loss normalisation alone.
Tolerances: float32 1e-5 (the same sums split 8 vs 4+4 round differently, ~1e-7
per step, amplified over 12 steps); float64 1e-10 (same argument, 2^-29 x smaller).
AdamW in float32 gets 1e-4: its step lr * m / (sqrt(v) + eps) has slope lr / eps
= 1e5 in the gradient where |g| << eps, so a 1e-10 rounding difference in a
near-zero gradient entry becomes ~1e-5 in that weight (measured: 2e-5..7e-5 in a
handful of entries, everything else ~1e-7). In float64 AdamW meets 1e-10.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from contrastive_accelerate.ckpt_diff import max_abs_diff
from contrastive_accelerate.data import load_image_dataset
from contrastive_accelerate.knn import RawPixels, knn_data, knn_top1
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.options import TrainConfig, check_launch

from launch import (
    ENV,
    LAUNCH_TIMEOUT_S,
    REPO,
    launch_command,
    make_image_folder,
    one_line_errors,
    train_pooled,
)

STEPS = "12"
EXACT = {"float32": 1e-5, "float64": 1e-10}
ADAMW_FLOAT32 = 1e-4
COMMON = [
    "--model",
    "mlp",
    "--no-augment",
    "--batch-size",
    "8",
    "--max-steps",
    STEPS,
    "--knn-k",
    "0",
    "--log-every",
    "4",
]


def _run(tmp_path_factory, num_processes: int, *args: str) -> str:
    output = tmp_path_factory.mktemp("run")
    train_pooled(num_processes, *COMMON, *args, "--output-dir", str(output))
    return str(output / "final")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Final models keyed by (processes, optimizer, dtype, gather), trained lazily."""
    cache: dict[tuple, str] = {}

    def get(processes: int, optimizer: str, dtype: str, gather: bool = True) -> str:
        key = (processes, optimizer, dtype, gather)
        if key not in cache:
            lr = "0.1" if optimizer == "sgd" else "0.001"
            cache[key] = _run(
                tmp_path_factory,
                processes,
                "--optimizer",
                optimizer,
                "--lr",
                lr,
                "--dtype",
                dtype,
                "--gather" if gather else "--no-gather",
            )
        return cache[key]

    return get


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_and_two_processes_train_the_same_model(runs, optimizer, dtype):
    diff = max_abs_diff(runs(1, optimizer, dtype), runs(2, optimizer, dtype))
    print(f"{optimizer} {dtype}: 1 vs 2 processes max abs diff {diff:.3e}")
    tolerance = ADAMW_FLOAT32 if (optimizer, dtype) == ("adamw", "float32") else EXACT[dtype]
    assert diff <= tolerance


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_negative_control_local_negatives_only(runs, dtype):
    """Without the gather each rank optimises its own local loss: far outside tolerance."""
    diff = max_abs_diff(runs(1, "sgd", dtype), runs(2, "sgd", dtype, gather=False))
    print(f"--no-gather {dtype}: 1 vs 2 processes max abs diff {diff:.3e}")
    assert diff > 100 * EXACT[dtype]


@pytest.fixture(scope="module")
def small_image_folder(tmp_path_factory):
    # 20 images, global batch 8: 3 steps per epoch, the last one short.
    return make_image_folder(tmp_path_factory.mktemp("images"), count=20)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_resume_mid_epoch_matches_straight_run(tmp_path, small_image_folder, num_processes):
    args = [
        "--dataset",
        str(small_image_folder),
        "--model",
        "mlp",
        "--image-size",
        "12",
        "--batch-size",
        "8",
        "--max-steps",
        "10",
        "--knn-k",
        "0",
        "--save-every",
        "4",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # The straight run's 2 persistent workers serve all 4 epochs; the resumed run loads in
    # the main process: the same batches and views either way.
    train_pooled(num_processes, *args, "--num-workers", "2", "--output-dir", str(straight))
    # Step 4 is mid-epoch (batch 1 of epoch 1), with shuffling and random augmentation on.
    train_pooled(
        num_processes,
        *args,
        "--num-workers",
        "0",
        "--output-dir",
        str(resumed),
        "--resume-from",
        str(straight / "checkpoint-4"),
    )
    diff = max_abs_diff(str(straight / "final"), str(resumed / "final"))
    print(f"{num_processes} process(es): straight (2 workers) vs resumed (none) {diff:.3e}")
    assert diff <= 1e-6
    assert not list(straight.glob(".*partial")), "a temporary checkpoint was left behind"
    assert (straight / "checkpoint-8" / "trainer_state.json").exists()


SUMMARY = re.compile(
    r"kNN top-1 \(k=5, (\d+) held-out images\): raw pixels (\d+\.\d)%, "
    r"random init (\d+\.\d)% -> trained (\d+\.\d)%\n"
    r"linear probe top-1 \((\d+) held-out images\): raw pixels (\d+\.\d)%, trained (\d+\.\d)%"
)


def _raw_pixel_knn(train, held_out) -> str:
    """kNN on raw pixels with the trainer's k, as the summary prints it."""
    data = knn_data(train, held_out, "image", "label", 8, False)
    return f"{knn_top1(RawPixels(), data, k=5):.1%}"


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """The summary of a short default-dataset run on 1 and 2 processes."""
    cache = {}

    def get(num_processes: int):
        if num_processes not in cache:
            output = tmp_path_factory.mktemp("summary")
            args = "--max-steps 2 --eval-every 1 --batch-size 16 --knn-k 5".split()
            cache[num_processes] = (
                train_pooled(num_processes, *args, "--output-dir", str(output)),
                output,
            )
        return cache[num_processes]

    return get


@pytest.mark.parametrize("num_processes", [1, 2])
def test_default_dataset_reports_knn_before_and_after(summaries, num_processes):
    """Every rank evaluates its share of the kNN (also mid-run); rank 0 prints the result."""
    result, tmp_path = summaries(num_processes)
    assert result.stdout.count("random init") == 1, result.stdout  # printed once, by rank 0
    assert "trained" in result.stdout
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert (tmp_path / "final" / "config.json").exists()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in record for record in records)
    assert any("knn_top1" in record for record in records)


def test_summary_states_the_raw_pixel_baseline_of_the_same_held_out_images(summaries):
    """The printed raw-pixel figure is kNN on the pixels of the images the encoder was scored
    on. Its control: the same count of other held-out digits gives another figure."""
    result, _ = summaries(1)
    match = SUMMARY.search(result.stdout)
    assert match, result.stdout
    held_out, raw_pixels = int(match.group(1)), match.group(2) + "%"
    assert int(match.group(5)) == held_out
    data = load_image_dataset(None)
    assert len(data.evaluation) == held_out
    assert raw_pixels == _raw_pixel_knn(data.train, data.evaluation)
    every = load_image_dataset(None, evaluate=False).train
    other = every.train_test_split(test_size=held_out, seed=1)  # another split, same size
    assert raw_pixels != _raw_pixel_knn(other["train"], other["test"])


def test_bad_input_unknown_dataset_path(tmp_path):
    result = train_pooled(
        2,
        *COMMON,
        "--dataset",
        str(tmp_path / "missing"),
        "--output-dir",
        str(tmp_path),
        check=False,
    )
    one_line_errors(result, "does not exist", 2)


def test_bad_input_batch_size_not_divisible(tmp_path):
    result = train_pooled(
        2, "--model", "mlp", "--batch-size", "7", "--output-dir", str(tmp_path), check=False
    )
    one_line_errors(result, "divisible by the 2 processes", 2)


def test_bad_input_missing_image_column(tmp_path, small_image_folder):
    result = train_pooled(
        2,
        *COMMON,
        "--dataset",
        str(small_image_folder),
        "--image-column",
        "photo",
        "--output-dir",
        str(tmp_path),
        check=False,
    )
    one_line_errors(result, "no image column 'photo'", 2)


def _checkpointing_run(max_steps: int, save_every: int) -> list[str]:
    return (
        f"--model mlp --batch-size 8 --max-steps {max_steps} --save-every {save_every} --knn-k 0"
    ).split()


def test_refuses_single_process_accelerate_under_a_multi_process_launch(monkeypatch):
    """The trap: a bare Accelerator() under a 2-process CPU launch reports one process."""

    class SingleProcessAccelerator:
        num_processes, distributed_type, mixed_precision = 1, "DistributedType.NO", "no"

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainerError, match="WORLD_SIZE=2 but Accelerate runs one"):
        check_launch(TrainConfig(batch_size=128), SingleProcessAccelerator(), True)


def test_resume_on_a_different_number_of_processes(tmp_path):
    """A checkpoint from 1 process continues on 2 to the same model (float32 tolerance)."""
    args = _checkpointing_run(max_steps=6, save_every=3)
    train_pooled(1, *args, "--output-dir", str(tmp_path / "one"))
    train_pooled(
        2,
        *args,
        "--output-dir",
        str(tmp_path / "two"),
        "--resume-from",
        str(tmp_path / "one" / "checkpoint-3"),
    )
    diff = max_abs_diff(str(tmp_path / "one" / "final"), str(tmp_path / "two" / "final"))
    print(f"1 process, resumed on 2: max abs diff {diff:.3e}")
    assert diff <= EXACT["float32"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="cores from sched_getaffinity")
@pytest.mark.parametrize("told", [None, "1"], ids=["launcher-default", "user-set-1"])
def test_a_lone_cpu_process_under_accelerate_launch_uses_every_core_unless_told(tmp_path, told):
    """``accelerate launch`` gives a lone process ``OMP_NUM_THREADS=1`` unless the user set
    it: the trainer then computes on every core. The control: the user's own 1 stays."""
    cores = len(os.sched_getaffinity(0))
    environment = {key: value for key, value in ENV.items() if key != "OMP_NUM_THREADS"}
    if told is not None:
        environment["OMP_NUM_THREADS"] = told
    command = launch_command(1, REPO / "trainer.py", "--model", "mlp", "--max-steps", "1",
                             "--knn-k", "0", "--num-workers", "0", "--output-dir",
                             str(tmp_path), launcher_flags=[])  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=environment,
                            timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    start = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    print(f"OMP_NUM_THREADS {told or 'unset'}, {cores} cores: {start['cpu_threads']} threads")
    assert start["cpu_threads"] == (cores if told is None else 1)


def test_train_step_alone_gives_the_same_step_in_any_number_of_chunks():
    """``trainer.train_step`` is the loop's step and runs without the loop: a method and
    an optimizer built as ``train`` builds them, two steps on the first 16 digits (float64,
    one process). In 4 chunks it gives the weights of 1 chunk (gradient caching is exact:
    1.4e-17 measured); the control, another learning rate, moves them by about 3e-2."""
    import torch
    from accelerate.utils import set_seed

    from contrastive_accelerate.methods import METHODS
    from contrastive_accelerate.optim import make_optimizer
    from trainer import train_step

    config = TrainConfig(model="mlp", dtype="float64", batch_size=16, knn_k=0).resolved()
    row = METHODS[config.method]
    data = row.load(config)
    weights = {}
    for chunks, lr in ((1, 0.1), (4, 0.1), (1, 0.2)):
        set_seed(config.seed)
        method = row.build(config, data, 1, print, total_steps=2, device=torch.device("cpu"))
        optimizer = make_optimizer(
            config.optimizer,
            method.model.parameters(),
            lr=lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
        )
        batch = method.dataset.collate([method.dataset[(0, index)] for index in range(16)])
        for step in range(2):
            loss = train_step(method.model, optimizer, method, batch, step=step, epoch=0,
                              lr=lr, chunks=chunks)  # fmt: skip
            assert torch.isfinite(loss)
        weights[chunks, lr] = {name: t.clone() for name, t in method.model.state_dict().items()}

    def difference(a: dict, b: dict) -> float:
        return max((a[name] - b[name]).abs().max().item() for name in a)

    chunked, control = (difference(weights[1, 0.1], weights[key]) for key in ((4, 0.1), (1, 0.2)))
    print(f"train_step in 4 chunks against 1: {chunked:.1e}; another lr: {control:.1e}")
    assert chunked <= 1e-12  # float64 summation order over the chunks
    assert control > 1e-6


def test_a_checkpoint_without_an_option_added_since_resumes_at_its_default(tmp_path):
    """A checkpoint of a version that had no such option (its saved options lack it) ran
    with the option's default: a resume at the default continues it exactly, one that
    sets the option is refused in one line (the control)."""
    args = ["--model", "mlp", "--max-steps", "3", "--batch-size", "16", "--save-every", "2",
            "--knn-k", "0", "--num-workers", "0"]  # fmt: skip
    straight = tmp_path / "straight"
    train_pooled(1, *args, "--output-dir", str(straight))
    state = straight / "checkpoint-2" / "trainer_state.json"
    saved = json.loads(state.read_text())
    del saved["config"]["seed"]  # as a version before --seed saved it
    state.write_text(json.dumps(saved))
    resume = ["--resume-from", str(straight / "checkpoint-2")]
    train_pooled(1, *args, *resume, "--output-dir", str(tmp_path / "resumed"))
    diff = max_abs_diff(str(straight / "final"), str(tmp_path / "resumed" / "final"))
    print(f"resumed from a checkpoint without --seed, at its default: {diff:.1e}")
    assert diff == 0.0
    refused = train_pooled(1, *args, *resume, "--seed", "1", "--output-dir",
                           str(tmp_path / "refused"), check=False)  # fmt: skip
    one_line_errors(refused, "--seed (not in the checkpoint)", 1)
