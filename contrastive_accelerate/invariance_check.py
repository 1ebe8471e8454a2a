"""invariance-check: does a training script train the same model on 1 and N processes?

    invariance-check --processes 1,2,3 --atol 1e-6 -- train.py --epochs 1 --lr 0.1

Runs the script under ``accelerate launch`` on each number of CPU processes, each with
``--output-dir DIR`` of its own (``--output-arg`` names another flag), and diffs the
final checkpoints against the first (``assert_training_invariant``, which
``contrastive_accelerate.testing`` exports with the rest of the kit). Exit codes as
``ckpt-diff``: 0 within tolerance, 1 over it, 2 a bad option, or a run that failed, hung
past ``--timeout`` (its processes are killed) or wrote no checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from contrastive_accelerate.ckpt_diff import WEIGHTS_SUFFIXES
from contrastive_accelerate.config import OneLineParser


def assert_training_invariant(
    command: Sequence[str],
    world_sizes: Sequence[int] = (1, 2),
    output_arg: str = "--output-dir",
    atol: float = 1e-6,
    timeout_s: float = 900,
) -> dict[int, float]:
    """Assert that ``accelerate launch COMMAND`` trains the same model on every world size.

    ``command`` is the script and its arguments; each launch gets ``output_arg DIR`` of
    its own, on CPU processes. The final checkpoint of each is ``DIR/final`` if there is
    one, else the newest weights file under ``DIR`` (safetensors, or a state dict read
    with ``torch.load(weights_only=True)``, which runs no code). Returns the max absolute
    difference of each world size against the first; raises ``AssertionError`` naming
    the worst tensor, or ``ValueError`` when a run fails or writes no checkpoint.
    """
    from contrastive_accelerate.ckpt_diff import compare

    with tempfile.TemporaryDirectory() as root:
        checkpoints = {}
        for world_size in world_sizes:
            output = Path(root, f"processes-{world_size}")
            launch = [*launch_command(world_size), *command, output_arg, str(output)]
            returncode, stderr = _run_launch(launch, timeout_s, world_size)
            if returncode != 0:
                raise ValueError(
                    f"{world_size} process(es): exited {returncode}: {script_error(stderr)}"
                )
            checkpoints[world_size] = final_checkpoint(output)
        figures, first = {}, world_sizes[0]
        for world_size in world_sizes[1:]:
            diffs = compare(checkpoints[first], checkpoints[world_size])
            problems = [f"{diff.name}: {diff.problem}" for diff in diffs if diff.problem]
            if problems:
                raise AssertionError(f"{first} vs {world_size} processes: {'; '.join(problems)}")
            worst = max(diffs, key=lambda diff: diff.max_abs, default=None)
            figures[world_size] = worst.max_abs if worst else 0.0
            if worst and not worst.max_abs <= atol:
                raise AssertionError(
                    f"{first} vs {world_size} processes: tensor {worst.name!r} differs by "
                    f"{worst.max_abs:.3e} (atol {atol:g})"
                )
        return figures


#: How long a launch told to stop may take to end its ranks before it is killed.
STOP_GRACE_S = 60.0


def _run_launch(command: list[str], timeout_s: float, world_size: int) -> tuple[int, str]:
    """Run a launch in a process group of its own. One that outlives ``timeout_s`` is
    stopped as a scheduler stops a job (``TimeoutError``): SIGTERM to its group, which
    torchrun passes on to its ranks (each in a session of its own, out of reach of the
    group) before it exits, then SIGKILL to what is left of the group."""
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=_launch_env(), start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        raise TimeoutError(
            f"{world_size} process(es): the launch did not finish within {timeout_s:g} s "
            f"(--timeout) and was stopped: {' '.join(command)}"
        ) from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.stderr.close()
    return process.returncode, stderr


#: The last line of a Python traceback, or a one-line ``error:``, as a rank prints it.
_SCRIPT_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+(?:Error|Exception)|error): .*)$")


#: A rank that lost its peer, rather than the rank whose own code failed.
_LOST_PEER = re.compile(r"gloo|nccl|c10d|Connection (reset|closed)|DistBackendError", re.I)


def script_error(stderr: str) -> str:
    """What the script itself said on failure: a rank's exception or ``error:`` line,
    that of a rank whose own code failed before one that lost its peer, never the
    launcher's report of a failed child; else the last lines."""
    matches = (_SCRIPT_ERROR.match(line.strip()) for line in stderr.splitlines())
    found = [match.group(1) for match in matches if match and "ChildFailedError" not in match[0]]
    if found:
        return min(found, key=lambda line: _LOST_PEER.search(line) is not None)[:400]
    return " ".join(stderr.strip().splitlines()[-3:])[-400:]


def launch_command(world_size: int) -> list[str]:
    """``accelerate launch`` on ``world_size`` CPU processes (gloo), without a config file."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    if world_size == 1:
        return [*command, "--num_processes", "1"]
    # --multi_gpu selects torchrun; without a GPU the processes join over gloo.
    return [*command, "--multi_gpu", "--num_processes", str(world_size), "--main_process_port", "0"]


def _launch_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **os.environ}


def final_checkpoint(output: Path) -> str:
    """``output/final`` if it holds weights, else the newest weights file under ``output``."""
    final = output / "final"
    if any((final / f"model{suffix}").exists() for suffix in WEIGHTS_SUFFIXES):
        return str(final)
    found = [path for path in output.rglob("*") if path.suffix in WEIGHTS_SUFFIXES]
    if not found:
        raise ValueError(
            f"the run wrote no checkpoint under {output} ({', '.join(WEIGHTS_SUFFIXES)})"
        )
    return str(max(found, key=lambda path: (path.stat().st_mtime, path.suffix == ".safetensors")))


def most_processes() -> int:
    """The most CPU processes one launch may start: 4 per core. More than that on one
    machine is a typo (``--processes 1,20000``), not a test: each process holds its own
    copy of the model and the data."""
    return 4 * (os.cpu_count() or 1)


def _processes(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) < 2 or min(counts) < 1 or len(set(counts)) < len(counts):
        raise argparse.ArgumentTypeError(
            f"expected two or more different counts like 1,2, got {text!r}"
        )
    if max(counts) > most_processes():
        raise argparse.ArgumentTypeError(
            f"at most {most_processes()} processes (4 per core of this machine's "
            f"{os.cpu_count()}), got {max(counts)}"
        )
    return counts


def _at_least_zero(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=_processes, default=[1, 2], help="e.g. 1,2,3")
    parser.add_argument("--atol", type=_at_least_zero, default=1e-6, help="max allowed |a - b|")
    parser.add_argument("--output-arg", default="--output-dir", help="the script's output flag")
    parser.add_argument("--timeout", type=_seconds, default=900, help="seconds per launch")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the training script after --")
    try:
        figures = assert_training_invariant(
            command, args.processes, args.output_arg, args.atol, args.timeout
        )
    except AssertionError as error:
        print(f"FAIL: {error}", flush=True)
        sys.exit(1)
    except (OSError, ValueError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    for count, diff in figures.items():
        print(f"{args.processes[0]} vs {count} processes: max abs diff {diff:.3e}")
    print(f"OK: within atol={args.atol:g}")


if __name__ == "__main__":
    main()
