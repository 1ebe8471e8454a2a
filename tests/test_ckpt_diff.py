"""ckpt-diff: numbers, structure problems and exit codes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from contrastive_accelerate.ckpt_diff import compare, main, max_abs_diff


def _save(path, **tensors):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_reports_per_tensor_differences_and_exit_codes(tmp_path, capsys):
    a = _save(tmp_path / "a", w=torch.zeros(3), b=torch.ones(2))
    b = _save(tmp_path / "b", w=torch.tensor([0.0, 2e-6, 0.0]), b=torch.ones(2))
    assert max_abs_diff(a, b) == pytest.approx(2e-6)
    with pytest.raises(SystemExit) as within:
        main([a, b, "--atol", "1e-5"])
    assert within.value.code == 0
    with pytest.raises(SystemExit) as over:
        main([a, b, "--atol", "1e-6"])
    assert over.value.code == 1
    assert "w" in capsys.readouterr().out


def test_names_missing_and_reshaped_tensors(tmp_path, capsys):
    a = _save(tmp_path / "a", w=torch.zeros(3), only_a=torch.zeros(1))
    b = _save(tmp_path / "b", w=torch.zeros(4), only_b=torch.zeros(1))
    problems = {diff.name: diff.problem for diff in compare(a, b)}
    assert problems == {"only_a": "only in A", "only_b": "only in B", "w": "shape (3,) vs (4,)"}
    with pytest.raises(SystemExit) as exit_info:
        main([a, b])
    assert exit_info.value.code == 1
    output = capsys.readouterr().out
    assert "only in A" in output and "shape (3,) vs (4,)" in output
    with pytest.raises(ValueError, match="differ in structure"):
        max_abs_diff(a, b)


def test_missing_file_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "x"), str(tmp_path / "y")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: no safetensors file")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x80\x04\x95 not safetensors", "is not a readable safetensors file"),
        (b"", "is not a readable safetensors file"),
    ],
    ids=["pickle-like bytes", "empty file"],
)
def test_unreadable_input_is_exit_2_not_over_tolerance(tmp_path, capfd, content, message):
    good = _save(tmp_path / "good", w=torch.zeros(3))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main([good, str(damaged)])
    assert exit_info.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_bad_tolerance_is_a_usage_error(tmp_path, capfd):
    good = _save(tmp_path / "good", w=torch.zeros(3))
    with pytest.raises(SystemExit) as exit_info:
        main([good, good, "--atol", "nan"])
    assert exit_info.value.code == 2
