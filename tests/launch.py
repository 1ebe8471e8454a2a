"""Run trainer.py under a real ``accelerate launch`` and make small offline datasets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
# Generous for a loaded 2-core CI machine; a hung collective fails one test, not CI.
LAUNCH_TIMEOUT_S = 300


def launch(
    num_processes: int, *trainer_args: str, timeout: int = LAUNCH_TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess:
    """``accelerate launch trainer.py ARGS`` on ``num_processes`` CPU processes."""
    if num_processes == 1:
        launcher = ["--config_file", str(CONFIGS / "single_process.yaml")]
    else:
        launcher = [
            "--config_file",
            str(CONFIGS / "cpu_2_processes.yaml"),
            "--num_processes",
            str(num_processes),
            "--main_process_port",
            "0",
        ]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        str(REPO / "trainer.py"),
        *trainer_args,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def make_image_folder(root: Path, count: int, size: int = 12, classes: int = 2) -> Path:
    """An ``imagefolder`` dataset of ``count`` random PNGs in ``classes`` label folders."""
    from PIL import Image

    generator = np.random.default_rng(0)
    for index in range(count):
        folder = root / "train" / f"class{index % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = generator.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index}.png")
    return root
