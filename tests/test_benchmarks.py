"""The benchmarks must run the day they are needed: the GPU check's smoke mode, and lightly's
methods through our pipeline, run here on the CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from launch import ENV, REPO


def test_gpu_benchmark_smoke_mode_runs_on_the_cpu(tmp_path):
    output = tmp_path / "gpu.json"
    command = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick"]
    result = subprocess.run(
        [*command, "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**ENV, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
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


def test_the_lightly_comparison_runs_end_to_end_on_the_cpu():
    """``benchmarks.lightly_methods``: lightly's DINO and BYOL through our data, backbone,
    optimizer and evaluation, 3 small steps each."""
    from benchmarks.lightly_methods import LIGHTLY_METHODS, lightly_run

    for method in LIGHTLY_METHODS:
        row = lightly_run(method, seed=0, quick=True)
        print(row)
        assert row["steps"] == 3
        assert 0 < row["knn_top1"] <= 1 and 0 < row["linear_probe_top1"] <= 1


def test_the_streaming_loader_benchmark_runs_on_the_cpu():
    """``benchmarks.streaming``: the streamed, map-style and webdataset loaders over the
    same shards, a few small batches each, without workers."""
    from benchmarks.streaming import run, table_lines

    results = run(quick=True)
    assert [row["loader"] for row in results["rows"]] == ["streamed", "map-style", "webdataset"]
    assert all(row["samples_per_s"] > 0 for row in results["rows"])
    print("\n".join(table_lines(results)))


def _published() -> bytes:
    return (REPO / "benchmarks" / "results.json").read_bytes()


def test_a_benchmark_run_writes_into_the_ignored_folder_not_the_published_figures(
    tmp_path, monkeypatch
):
    """``python -m benchmarks.run --quick`` (its measurements stubbed: the paths are the
    point) and a module run alone write ``benchmarks/results/`` under the folder they run
    in, which git ignores; ``benchmarks/results.json`` stays byte for byte as it was."""
    import benchmarks.run
    from benchmarks import standalone

    published = _published()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(benchmarks.run, "run", lambda quick: {"quick": quick})
    monkeypatch.setattr(benchmarks.run, "table", lambda results: "the table")
    benchmarks.run.main(["--quick"])
    standalone.main("probe", "a probe", lambda quick: {"quick": quick}, lambda r: [], ["--quick"])
    assert json.loads((tmp_path / "benchmarks" / "results" / "run.json").read_text()) == {
        "quick": True
    }
    probe = json.loads((tmp_path / "benchmarks" / "results" / "probe.json").read_text())
    assert probe == {"probe": {"quick": True}}
    assert _published() == published
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q",
                              "benchmarks/results/run.json"], timeout=60)  # fmt: skip
    assert ignored.returncode == 0  # git ignores the default folder


def test_quick_never_publishes_and_publish_is_the_published_file(tmp_path, monkeypatch, capsys):
    """``--quick --publish`` is refused before anything runs; ``--publish`` alone writes
    the published file."""
    import benchmarks.run
    from benchmarks import standalone

    monkeypatch.chdir(tmp_path)
    ran = []
    monkeypatch.setattr(benchmarks.run, "run", ran.append)
    with pytest.raises(SystemExit) as refused:
        benchmarks.run.main(["--quick", "--publish"])
    assert refused.value.code == 2 and ran == []
    assert "--publish refreshes the published figures" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    standalone.add_output_arguments(parser, "run")
    publish = parser.parse_args(["--publish"])
    publish.quick = False
    assert standalone.results_path(parser, publish, "run") == REPO / "benchmarks" / "results.json"


def test_the_recipe_search_tables_and_plots_every_recipe_with_runs():
    """Runs are stored under the recipe's resolved options: the README's command as
    written shares the runs of the recipe it equals; a recipe is above raw pixels only
    if every one of its seeds is."""
    from benchmarks.recipes import RECIPES, plot, recipe_key, table_lines

    def row(name: str, seed: int, knn: float) -> dict:
        return {"key": recipe_key(RECIPES[name][1].split()), "seed": seed, "seconds": 600.0,
                "knn_top1": knn, "linear_probe_top1": 0.98, "knn_top1_init": 0.94,
                "raw_pixels_knn_top1": 0.989}  # fmt: skip

    rows = [row("old-default", 0, 0.97), row("old-default", 1, 0.99)]
    rows += [row("affine-75-epochs", seed, 0.992) for seed in (0, 1)]
    lines = table_lines(rows)
    table = {line.split("|")[1].strip(): line.split("|")[5].strip() for line in lines
             if line.startswith("| `")}  # fmt: skip
    assert table == {"`old-default`": "no", "`affine-75-epochs`": "yes", "`default`": "no"}
    svg = plot(rows)
    assert svg.startswith("<svg") and svg.count("<circle") == 2 and "raw pixels 98.9%" in svg
    assert "old-default = default" in svg  # one point for the runs they share
