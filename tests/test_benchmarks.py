"""The one-command GPU check must run the day a GPU is there: its smoke mode runs here."""

from __future__ import annotations

import json
import subprocess
import sys

from launch import ENV, REPO


def test_gpu_benchmark_smoke_mode_runs_on_the_cpu(tmp_path):
    output = tmp_path / "gpu.json"
    command = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick"]
    result = subprocess.run(
        [*command, "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    assert {"loss", "trainer", "sync_batchnorm", "syncs_per_step", "clip", "fsdp"} <= results.keys()
    assert [(row["tower"], row["fsdp"]) for row in results["fsdp"]] == [
        ("tiny-bert", False),
        ("tiny-bert", True),
        ("tiny-vit", False),
        ("tiny-vit", True),
    ]
    assert [row["training"] for row in results["clip"]] == ["whole", "LoRA r16"]
    assert [row["precision"] for row in results["trainer"]] == ["no", "bf16"]
    assert "| precision | trainer.py | hand-written loop | ratio |" in result.stdout
