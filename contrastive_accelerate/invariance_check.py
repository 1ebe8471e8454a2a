"""invariance-check: does a training script train the same model on 1 and N processes?

    invariance-check --processes 1,2,3 --atol 1e-6 -- train.py --epochs 1 --lr 0.1

Runs the script under ``accelerate launch`` on each number of CPU processes, each with
``--output-dir DIR`` of its own (``--output-arg`` names another flag), and diffs the
final checkpoints against the first (``contrastive_accelerate.testing``). Exit codes as
``ckpt-diff``: 0 within tolerance, 1 over it, 2 a run failed or wrote no checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from contrastive_accelerate.testing import assert_training_invariant


def _processes(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) < 2 or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected two or more counts like 1,2, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=_processes, default=[1, 2], help="e.g. 1,2,3")
    parser.add_argument("--atol", type=float, default=1e-6, help="max allowed |a - b|")
    parser.add_argument("--output-arg", default="--output-dir", help="the script's output flag")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
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
