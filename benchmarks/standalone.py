"""One benchmark module run alone: its table printed, its results merged into a results
file, and what every benchmark shares: where results go, the README's run, saved runs.

A benchmark writes into ``benchmarks/results/`` (ignored by git), or the file ``--output``
names, so that no run changes the published figures; ``--publish`` refreshes them:
``benchmarks/results.json``'s entry and the benchmark's table in ``docs/``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
#: The published figures (tracked): written only by ``--publish``.
PUBLISHED = REPO / "benchmarks" / "results.json"
#: Where a benchmark run from the repository's root writes unless told (ignored by git).
RESULTS = Path("benchmarks") / "results"


def main(
    name: str,
    description: str,
    run: Callable[[bool], dict],
    table_lines: Callable[[dict], list[str]],
    argv: Sequence[str] | None = None,
    page: str | None = None,
) -> None:
    """``python -m benchmarks.<name> [--quick] [--output FILE | --publish]``; ``--publish``
    also writes the table into ``docs/PAGE`` when the benchmark has one."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    add_output_arguments(parser, name)
    args = parser.parse_args(argv)
    path = results_path(parser, args, name)
    results = run(args.quick)
    merge(path, name, results)
    lines = table_lines(results)
    print("\n".join(lines))
    if args.publish and page:
        write_docs(name, lines, page)
    print(f"\nwrote {path}")


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--output FILE`` and ``--publish``, the same for every benchmark (it has ``--quick``)."""
    parser.add_argument(
        "--output", help=f"the results file; default {RESULTS / name}.json (ignored by git)"
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help="refresh the published figures: benchmarks/results.json and, for a benchmark "
        "with one, its table in docs/",
    )


def results_path(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> Path:
    """The file a run writes: ``PUBLISHED`` for ``--publish`` (a full run only), else
    ``--output`` or ``RESULTS/<name>.json``. Refused in one line before anything runs."""
    if args.publish and args.quick:
        parser.error("--publish refreshes the published figures: a full run, not --quick")
    if args.publish and args.output:
        parser.error(f"--publish writes {PUBLISHED.relative_to(REPO)}: leave --output out")
    path = PUBLISHED if args.publish else Path(args.output or RESULTS / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def stored(path: Path) -> dict:
    """The results file's entries; none if it is missing or unreadable."""
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):  # none yet, or unreadable: start a new one
        return {}


def merge(path: Path, name: str, results: dict) -> None:
    """``results`` as the entry ``name`` of the results file, the other entries kept."""
    everything = stored(path)
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


def readme_run(
    arguments: list[str], threads: int | None = None, kept: Path | None = None
) -> tuple[subprocess.CompletedProcess, float, list[dict]]:
    """The README's first command with ``arguments`` (offline, into a temporary
    ``--output-dir``, or ``kept``, which stays; under ``OMP_NUM_THREADS=threads`` when
    given): the finished process, its wall seconds and the records of its
    ``metrics.jsonl`` (none if it failed)."""
    env = {"TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"OMP_NUM_THREADS": str(threads)} if threads else {}
    directory = contextlib.nullcontext(str(kept)) if kept else tempfile.TemporaryDirectory()
    with directory as output:
        command = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "accelerate_configs" / "single_process.yaml"),
            str(REPO / "trainer.py"), "--output-dir", output, *arguments,
        ]  # fmt: skip
        started = time.perf_counter()
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **env}
        )
        seconds = time.perf_counter() - started
        records = []
        if result.returncode == 0:
            lines = Path(output, "metrics.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
    return result, seconds, records


def digest(*values: object) -> str:
    """A short digest of JSON-able ``values``: what a saved run was run with."""
    text = json.dumps(values, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def recipe_digest(config: object, *extra: object) -> str:
    """The digest of what a training run is run with: ``config.resolved()`` (a trainer
    config, its defaults filled in) and ``extra``. A saved run counts only while its recipe
    is today's; code changes are not in it, so delete the saved runs after a model change."""
    return digest(dataclasses.asdict(config.resolved()), *extra)


def saved_rows(saved: Path) -> list[dict]:
    """The rows of a ``resumable_runs`` file that finished without an error."""
    if not saved.exists():
        return []
    rows = [json.loads(line) for line in saved.read_text().splitlines() if line.strip()]
    return [row for row in rows if "error" not in row]


def resumable_runs(
    jobs: Sequence[Hashable],
    run_one: Callable[[Hashable], dict],
    job_of: Callable[[dict], Hashable],
    recipe_of: Callable[[Hashable], str],
    saved: Path | None,
    parallel: int = 1,
) -> list[dict]:
    """Each job's row, in the order of ``jobs``: ``run_one(job)``, ``parallel`` at a time,
    tagged ``recipe`` with ``recipe_of(job)``. ``saved``: a JSON-lines file that each
    finished row is appended to and whose rows of today's recipe (and without an error) are
    not run again, so that hours of runs survive an interruption."""
    rows = []
    if saved is not None:
        rows = [row for row in saved_rows(saved) if job_of(row) in jobs
                and row.get("recipe") == recipe_of(job_of(row))]  # fmt: skip
    done = {job_of(row) for row in rows}
    with ThreadPoolExecutor(parallel) as pool:
        running = {pool.submit(run_one, job): job for job in jobs if job not in done}
        for finished in as_completed(running):
            rows.append({**finished.result(), "recipe": recipe_of(running[finished])})
            print(f"run: {rows[-1]}", flush=True)
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                with saved.open("a") as file:
                    file.write(json.dumps(rows[-1]) + "\n")
    order = {job: position for position, job in enumerate(jobs)}
    return sorted(rows, key=lambda row: order[job_of(row)])
