"""Compare two checkpoints tensor by tensor.

    ckpt-diff runs/a/final runs/b/final --atol 1e-5

Each side is a ``.safetensors`` file, a state dict saved by ``torch.save`` (``.pt``,
``.pth``, ``.bin``: read with ``weights_only=True``), or a directory holding
``model.safetensors`` (a ``final/`` model or a ``checkpoint-<step>/``). Prints the max
absolute and relative difference of every tensor, names tensors missing on one
side or with different shapes. Exit codes: 0 within tolerance, 1 over tolerance or
different tensor sets, 2 unreadable input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

#: Weights files read, in the order a directory's ``model.<suffix>`` is looked for.
WEIGHTS_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


@dataclass
class TensorDiff:
    name: str
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    problem: str | None = None  # "only in A", "only in B", "shape ..."


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of a state dict saved by ``torch.save`` (read
    with ``weights_only=True``, which unpickles tensors and plain containers only)."""
    if os.path.isdir(path):
        candidates = [os.path.join(path, f"model{suffix}") for suffix in WEIGHTS_SUFFIXES]
        path = next((candidate for candidate in candidates if os.path.isfile(candidate)), path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no safetensors file at {path!r}")
    if not path.endswith(".safetensors"):
        return _load_state_dict(path)
    try:
        return load_file(path)
    except (OSError, SafetensorError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "unreadable"
        raise ValueError(f"{path!r} is not a readable safetensors file: {reason}") from None


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle raises many types; the user needs one line
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "unreadable"
        raise ValueError(f"{path!r} is not a readable state dict: {reason}") from None
    tensors = state if isinstance(state, dict) else {}
    tensors = {name: value for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    if not tensors:
        raise ValueError(f"{path!r} holds no state dict of tensors")
    return tensors


def compare(path_a: str, path_b: str) -> list[TensorDiff]:
    """Per-tensor differences between two checkpoints, in float64."""
    tensors_a, tensors_b = load_tensors(path_a), load_tensors(path_b)
    diffs = []
    for name in sorted(tensors_a.keys() | tensors_b.keys()):
        if name not in tensors_b:
            diffs.append(TensorDiff(name, problem="only in A"))
        elif name not in tensors_a:
            diffs.append(TensorDiff(name, problem="only in B"))
        elif tensors_a[name].shape != tensors_b[name].shape:
            shapes = f"{tuple(tensors_a[name].shape)} vs {tuple(tensors_b[name].shape)}"
            diffs.append(TensorDiff(name, problem=f"shape {shapes}"))
        else:
            a, b = tensors_a[name].double(), tensors_b[name].double()
            if a.numel() == 0:
                diffs.append(TensorDiff(name, 0.0, 0.0))
                continue
            max_abs = (a - b).abs().max().item()
            scale = max(a.abs().max().item(), b.abs().max().item())
            diffs.append(TensorDiff(name, max_abs, max_abs / scale if scale else 0.0))
    return diffs


def max_abs_diff(path_a: str, path_b: str) -> float:
    """The largest absolute difference over all tensors; raises if the tensor sets differ."""
    diffs = compare(path_a, path_b)
    problems = [f"{diff.name}: {diff.problem}" for diff in diffs if diff.problem]
    if problems:
        raise ValueError("checkpoints differ in structure: " + "; ".join(problems))
    return max(diff.max_abs for diff in diffs)


def _tolerance(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--atol", type=_tolerance, default=1e-5, help="max allowed |a - b|")
    parser.add_argument("--quiet", action="store_true", help="print only the summary line")
    args = parser.parse_args(argv)
    try:
        diffs = compare(args.a, args.b)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    failures = 0
    width = max((len(diff.name) for diff in diffs), default=4)
    if not args.quiet:
        print(f"{'tensor':<{width}}  {'max abs':>10}  {'max rel':>10}")
    for diff in diffs:
        bad = diff.problem is not None or not diff.max_abs <= args.atol
        failures += bad
        if not args.quiet:
            detail = diff.problem or f"{diff.max_abs:10.3e}  {diff.max_rel:10.3e}"
            print(f"{diff.name:<{width}}  {detail}{'  OVER' if bad else ''}")
    worst = max((d.max_abs for d in diffs if d.problem is None), default=0.0)
    verdict = "FAIL" if failures else "OK"
    print(
        f"{verdict}: {len(diffs)} tensors, max abs diff {worst:.3e}, "
        f"{failures} over atol={args.atol:g} or mismatched"
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
