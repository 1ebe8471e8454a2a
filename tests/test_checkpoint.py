"""Checkpoint files: exact round trip, no code execution, strict loading, one run per directory."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from contrastive_accelerate.checkpoint import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    CheckpointError,
    RunState,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
    load_optimizer_state,
    save_checkpoint,
)
from contrastive_accelerate.durable_files import NonFiniteTensor, check_finite
from contrastive_accelerate.run_directory import RunDirectory


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def _trained(optimizer_name: str, steps: int = 3):
    model = _model()
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.1)
        if optimizer_name == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    for step in range(steps):
        model(
            torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        ).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _step(model, optimizer, seed: int) -> None:
    model(
        torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    ).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _save(tmp_path, model, optimizer, step=3) -> str:
    return save_checkpoint(str(tmp_path), step, model, optimizer, RunState({"lr": 0.1}, 100, 2))


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_round_trip_continues_exactly(tmp_path, optimizer_name):
    model, optimizer = _trained(optimizer_name)
    path = _save(tmp_path, model, optimizer)
    restored_model, restored_optimizer = _trained(optimizer_name, steps=0)
    checkpoint = load_checkpoint(path)
    load_model_state(restored_model, checkpoint)
    load_optimizer_state(restored_optimizer, checkpoint)
    assert (checkpoint.step, checkpoint.config, checkpoint.train_samples) == (3, {"lr": 0.1}, 100)
    for seed in (10, 11):  # the optimizer state matters from the next step on
        _step(model, optimizer, seed)
        _step(restored_model, restored_optimizer, seed)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, restored_model.state_dict()[name]), name
    assert sorted(os.listdir(path)) == sorted([MODEL_FILE, OPTIMIZER_FILE, STATE_FILE])


class _Payload:
    """Unpickling this runs a shell command, as a crafted checkpoint file would."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("victim", [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE])
@pytest.mark.parametrize("container", ["pickle", "torch.save"])
def test_a_pickle_in_any_file_is_refused_and_never_run(tmp_path, victim, container):
    model, optimizer = _trained("sgd")
    path = _save(tmp_path / "run", model, optimizer)
    marker = tmp_path / "payload-ran"
    if container == "pickle":
        (tmp_path / "run" / "checkpoint-3" / victim).write_bytes(pickle.dumps(_Payload(marker)))
    else:
        torch.save({"state": _Payload(marker)}, str(tmp_path / "run" / "checkpoint-3" / victim))
    # Reference: the payload really runs when unpickled the way Accelerate loads its files.
    pickle.loads(pickle.dumps(_Payload(tmp_path / "control-ran")))
    assert (tmp_path / "control-ran").exists()
    with pytest.raises(CheckpointError, match="corrupt checkpoint|incomplete checkpoint"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["model", "optimizer"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_state_is_never_written_and_latest_stays(tmp_path, where, value):
    """A save of a state holding a NaN or an infinity writes nothing: the error names the
    tensor and the last complete checkpoint, which ``latest`` still names."""
    model, optimizer = _trained("adamw")
    good = _save(tmp_path, model, optimizer, step=3)
    with torch.no_grad():
        if where == "model":
            model[0].weight[1, 2] = value
        else:
            optimizer.state[model[0].bias]["exp_avg"][0] = value
    with pytest.raises(CheckpointError) as refused:
        _save(tmp_path, model, optimizer, step=4)
    tensor = "0.weight" if where == "model" else "state.1.exp_avg"
    assert f"tensor {tensor!r} holds a NaN or an infinity" in str(refused.value)
    assert f"the last complete checkpoint is {good}" in str(refused.value)
    assert latest_checkpoint(str(tmp_path)) == good
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]  # no partial left either


def test_a_non_finite_value_in_a_checkpoint_is_refused_at_load_naming_it(tmp_path):
    """A checkpoint made elsewhere (or damaged) with a NaN in its weights, its BatchNorm
    statistics or its optimizer state is refused before anything is loaded; the same
    checkpoint without the planted value loads (the control)."""
    from safetensors.torch import load_file, save_file

    model, optimizer = _trained("adamw")
    path = _save(tmp_path, model, optimizer)
    load_checkpoint(path)  # the control: the untouched checkpoint loads
    for name, tensor in (("model.safetensors", "1.running_var"),
                         ("optimizer.safetensors", "state.0.exp_avg_sq")):  # fmt: skip
        planted = shutil.copytree(path, tmp_path / f"planted-{name}")
        tensors = load_file(planted / name)
        tensors[tensor].view(-1)[0] = float("nan")
        save_file(tensors, planted / name)
        with pytest.raises(CheckpointError, match=rf"{name}: tensor {tensor!r} holds a NaN"):
            load_checkpoint(str(planted))


def test_strict_loading_names_the_mismatch(tmp_path):
    model, optimizer = _trained("sgd")
    checkpoint = load_checkpoint(_save(tmp_path, model, optimizer))
    wider = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    with pytest.raises(CheckpointError, match="does not match this model: .*size mismatch"):
        load_model_state(wider, checkpoint)
    with pytest.raises(CheckpointError, match="Unexpected key"):
        load_model_state(torch.nn.Sequential(torch.nn.Linear(4, 3)), checkpoint)
    wrong_optimizer = torch.optim.SGD(wider.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="does not match parameter 0"):
        load_optimizer_state(wrong_optimizer, checkpoint)
    fewer = torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="does not match this model's parameters"):
        load_optimizer_state(fewer, checkpoint)


def test_latest_ignores_partial_and_incomplete_directories(tmp_path):
    model, optimizer = _trained("sgd")
    for step in (9, 10, 2):
        save_checkpoint(str(tmp_path), step, model, optimizer, RunState({}, 1, 1))
    shutil.copytree(tmp_path / "checkpoint-10", tmp_path / ".checkpoint-11.partial")
    shutil.copytree(tmp_path / "checkpoint-10", tmp_path / "checkpoint-12")
    (tmp_path / "checkpoint-12" / STATE_FILE).write_text('{"step": 12')  # cut short
    shutil.copytree(tmp_path / "checkpoint-10", tmp_path / "checkpoint-13")
    (tmp_path / "checkpoint-13" / STATE_FILE).unlink()
    shutil.copytree(tmp_path / "checkpoint-10", tmp_path / "checkpoint-14")
    # Nested deeper than json's stack: a RecursionError in any run's scan, were it not caught.
    (tmp_path / "checkpoint-14" / STATE_FILE).write_text("[" * 200_000 + "]" * 200_000)
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == [
        "checkpoint-2",
        "checkpoint-9",
        "checkpoint-10",
    ]
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(str(tmp_path / "checkpoint-14"))
    assert str(refused.value) == (
        f"{str(tmp_path / 'checkpoint-14')!r}: incomplete checkpoint (no valid {STATE_FILE}: "
        "nested too deeply to read)"
    )


def test_output_directory_rules(tmp_path):
    model, optimizer = _trained("sgd")
    run = RunDirectory(str(tmp_path))
    assert run.claim(None, False) is None  # empty: a fresh start
    _save(tmp_path, model, optimizer, step=4)
    _save(tmp_path, model, optimizer, step=8)
    run.release()
    with pytest.raises(CheckpointError, match="already holds another run"):
        run.claim(None, False)
    run.release()
    assert run.claim("latest", False) == str(tmp_path / "checkpoint-8")

    other = RunDirectory(str(tmp_path))
    with pytest.raises(CheckpointError, match=f"in use by another run \\(pid {os.getpid()}\\)"):
        other.claim("latest", False)
    run.release()  # the lock goes with the holder
    assert other.claim(None, True) is None  # overwrite: the old run's files go
    assert complete_checkpoints(str(tmp_path)) == []
    other.release()

    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match="is a file"):
        RunDirectory(str(tmp_path / "a-file")).claim(None, False)


def test_a_refused_claim_leaves_the_directory_unlocked(tmp_path):
    """A pipeline calling train() again in the same process: a run refused for the
    directory's contents must not keep its lock, or every later run there is refused as
    "in use" until the process ends."""
    model, optimizer = _trained("sgd")
    _save(tmp_path, model, optimizer, step=4)
    refused = RunDirectory(str(tmp_path))
    with pytest.raises(CheckpointError, match="already holds another run"):
        refused.claim(None, False)
    later = RunDirectory(str(tmp_path))
    assert later.claim("latest", False) == str(tmp_path / "checkpoint-4")
    # The control: a claim that succeeded holds the lock until released.
    with pytest.raises(CheckpointError, match="in use by another run"):
        RunDirectory(str(tmp_path)).claim("latest", False)
    later.release()


def test_retention_keeps_the_newest(tmp_path):
    model, optimizer = _trained("sgd")
    for step in (1, 2, 3, 10):
        _save(tmp_path, model, optimizer, step=step)
    RunDirectory(str(tmp_path)).prune(2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-3"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.complex64])  # fmt: skip
@pytest.mark.parametrize("planted", [float("nan"), float("inf"), float("-inf"), None])
def test_the_finiteness_check_finds_every_non_finite_value_in_every_dtype(dtype, planted):
    """The check reads two extremes (``aminmax``): each kind of value is found wherever it
    sits, an unplanted tensor passes (the control), and integer or empty tensors too."""
    for position in (0, 17, 99):
        tensor = torch.linspace(-3, 3, 100).to(dtype)
        if planted is not None:
            tensor[position] = planted
            with pytest.raises(NonFiniteTensor, match="tensor 'w' holds a NaN or an infinity"):
                check_finite("w", tensor)
        else:
            check_finite("w", tensor)
    check_finite("steps", torch.arange(5))
    check_finite("empty", torch.empty(0, dtype=dtype))
