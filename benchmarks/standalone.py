"""One benchmark module run alone: its table printed, its results merged into the results
file that ``python -m benchmarks.run`` writes whole."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def main(
    name: str,
    description: str,
    run: Callable[[bool], dict],
    table_lines: Callable[[dict], list[str]],
) -> None:
    """``python -m benchmarks.<name> [--quick] [--output FILE]``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--output", default="benchmarks/results.json")
    args = parser.parse_args()
    results = run(args.quick)
    merge(args.output, name, results)
    print("\n".join(table_lines(results)))


def merge(path: str, name: str, results: dict) -> None:
    """``results`` as the entry ``name`` of the results file, the other entries kept."""
    try:
        with open(path) as file:
            everything = json.load(file)
    except (OSError, ValueError):  # none yet, or unreadable: start a new one
        everything = {}
    everything[name] = results
    with open(path, "w") as file:
        json.dump(everything, file, indent=2)


def write_docs(name: str, lines: list[str], page: str) -> None:
    """Replace the text of ``docs/PAGE`` between ``<!-- benchmarks.NAME: start -->`` and
    its end marker with ``lines``: the one place of a benchmark's figures."""
    path = DOCS / page
    start_marker, end_marker = (
        f"<!-- benchmarks.{name}: start -->",
        f"<!-- benchmarks.{name}: end -->",
    )
    text = path.read_text()
    start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
    path.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + text[end:])
