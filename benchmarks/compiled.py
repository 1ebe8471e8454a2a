"""trainer.py eager against ``--dynamo_backend inductor`` on CPU processes.

For each model and 1 and 2 processes, eager and compiled launches alternate. A run's
step time is the median over its steps after the first ``WARMUP`` (compilation happens
in the first), from the cumulative samples/s that ``metrics.jsonl`` logs every step.
The 1-vs-2-process difference of each mode is the largest weight difference of the
final checkpoints of short float64 runs (float32 rounding, amplified by BatchNorm,
would hide what the compiler changes).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks import standalone
from contrastive_accelerate.ckpt_diff import max_abs_diff
from contrastive_accelerate.testing import final_checkpoint, launch_command

WARMUP = 3
TRAINER = Path(__file__).resolve().parents[1] / "trainer.py"
MODES = {"eager": [], "inductor": ["--dynamo_backend", "inductor"]}


def _launch(processes: int, mode: str, output: Path, *args: str) -> None:
    # The mode's launcher flag comes after launch_command's "--dynamo_backend no": it wins.
    command = [*launch_command(processes), *MODES[mode], str(TRAINER), *args]
    subprocess.run(
        [*command, "--knn-k", "0", "--output-dir", str(output)],
        check=True,
        capture_output=True,
        timeout=1800,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )


def step_seconds(output: Path, batch_size: int, warmup: int = WARMUP) -> float:
    """Median step time after ``warmup`` steps, from the cumulative samples/s that
    ``metrics.jsonl`` has for every step (``--log-every 1``)."""
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    rates = [(r["step"], r["samples_per_s"]) for r in records if "samples_per_s" in r]
    elapsed = [step * batch_size / rate for step, rate in rates]
    steps = [later - earlier for earlier, later in zip(elapsed, elapsed[1:], strict=False)]
    return statistics.median(steps[warmup:])


def run(quick: bool) -> dict:
    steps, repeats, batch_size = (8, 1, 32) if quick else (20, 2, 64)
    models = ["mlp"] if quick else ["resnet18"]  # ViT-Tiny compiles for minutes on 2 cores
    results: dict = {"steps": steps, "batch_size": batch_size, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for model in models:
            args = ["--model", model, "--batch-size", str(batch_size), "--log-every", "1"]
            for processes in (1, 2):
                seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
                for repeat in range(repeats):
                    for mode in MODES:
                        output = root / f"{model}-{processes}-{mode}-{repeat}"
                        _launch(processes, mode, output, *args, "--max-steps", str(steps))
                        seconds[mode].append(step_seconds(output, batch_size))
                median = {mode: statistics.median(values) for mode, values in seconds.items()}
                results["rows"].append(
                    {"model": model, "processes": processes, "step_seconds": median,
                     "ratio": median["inductor"] / median["eager"]}
                )  # fmt: skip
            exact = ["--model", model, "--batch-size", "8", "--dtype", "float64"]
            for mode in MODES:
                outputs = [root / f"{model}-exact-{mode}-{n}" for n in (1, 2)]
                for processes, output in zip((1, 2), outputs, strict=True):
                    _launch(processes, mode, output, *exact, "--max-steps", "3")
                results.setdefault("one_vs_two", {}).setdefault(model, {})[mode] = max_abs_diff(
                    final_checkpoint(outputs[0]), final_checkpoint(outputs[1])
                )
    return results


def table_lines(results: dict) -> list[str]:
    lines = [
        f"trainer.py eager vs `--dynamo_backend inductor`, CPU processes, global batch "
        f"{results['batch_size']}, float32 (median step time after {WARMUP} steps; "
        f"1-vs-2-process weight difference after 3 float64 steps)",
        "",
        "| model | processes | eager | inductor | inductor / eager | 1 vs 2, eager | "
        "1 vs 2, inductor |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        exact = results["one_vs_two"][row["model"]]
        seconds = row["step_seconds"]
        lines.append(
            f"| {row['model']} | {row['processes']} | {seconds['eager'] * 1e3:.0f} ms "
            f"| {seconds['inductor'] * 1e3:.0f} ms | {row['ratio']:.2f} "
            f"| {exact['eager']:.1e} | {exact['inductor']:.1e} |"
        )
    return lines


if __name__ == "__main__":
    standalone.main("compiled", __doc__.split("\n")[0], run, table_lines)
