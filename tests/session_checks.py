"""What a test session must leave as it found it, checked when it ends: the checkout (what
``git status`` lists, ignored files included) and the processes (none that the session
started may outlive it). Either failing fails the session, naming what was left.

A pytest plugin: ``tests/conftest.py`` takes its hooks, and ``tests/test_session_checks.py``
runs it in throwaway sessions (``python -m pytest -p session_checks``) to show that each
check fails when a test leaves a file or a process behind.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

#: Every process the session starts inherits this mark (``launch.ENV`` is built from the
#: environment at import): what is still alive with it at the end was left behind.
SESSION_MARK = "CONTRASTIVE_ACCELERATE_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, str(os.getpid()))

#: What Python, pytest, ruff and pip write into any checkout they run in: not the tests'.
CACHES = ("__pycache__", ".pytest_cache", ".ruff_cache")

#: The command line of multiprocessing's resource tracker.
TRACKER = "from multiprocessing.resource_tracker import main"

_checkout_before: dict[str, tuple] | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--left-behind-grace",
        type=float,
        default=20.0,
        help="seconds the session waits for its processes to exit before failing (a pool's "
        "workers exit within 5 s of their pytest process; xdist's take a moment too)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    global _checkout_before
    if not _is_worker(session):
        _checkout_before = checkout_state(session.config.rootpath)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session fails if one of its processes outlives it or the checkout changed."""
    if _is_worker(session):  # an xdist worker: its controller checks the whole session
        return
    from contrastive_accelerate.workers import close_workers

    close_workers()  # this process's own pool (a run without xdist)
    deadline = time.monotonic() + session.config.getoption("left_behind_grace")
    while (left := processes_left_behind()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        _fail(session, "processes left behind by the tests", left)
    after = checkout_state(session.config.rootpath)
    if _checkout_before is not None and after is not None:
        changed = checkout_changes(_checkout_before, after)
        if changed:
            _fail(session, "the tests changed the checkout (git status)", changed)


def processes_left_behind() -> list[str]:
    """This session's processes that are still alive, but for this one and its own
    multiprocessing resource tracker (which exits with it): pid and command."""
    mark, left = os.environ[SESSION_MARK], []
    for process in psutil.process_iter(["pid", "ppid", "cmdline"]):
        try:
            if process.pid == os.getpid() or process.environ().get(SESSION_MARK) != mark:
                continue
            command = " ".join(process.info["cmdline"] or [])
            if process.info["ppid"] != os.getpid() or TRACKER not in command:
                left.append(f"{process.pid}: {command[:200]}")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return left


def checkout_state(root: Path) -> dict[str, tuple] | None:
    """``{path: (git status, size, modification time)}`` for each path that ``git status``
    lists in the checkout holding ``root`` (untracked and ignored files one by one, caches
    left out): a changed, new or vanished entry is a change. None outside a git checkout."""
    try:
        top = _git(root, "rev-parse", "--show-toplevel").strip()
        listed = _git(
            root, "status", "--porcelain", "-z", "--ignored", "--untracked-files=all"
        ).split("\0")
    except (OSError, subprocess.SubprocessError):
        return None
    state, entries = {}, iter(listed)
    for entry in entries:
        if not entry:
            continue
        status, path = entry[:2], entry[3:]
        if "R" in status or "C" in status:  # a rename's source follows: the same change
            next(entries, None)
        if any(part in CACHES or part.endswith(".egg-info") for part in Path(path).parts):
            continue
        try:
            stat = os.lstat(os.path.join(top, path))
            state[path] = (status, stat.st_size, stat.st_mtime_ns)
        except OSError:
            state[path] = (status, None, None)
    return state


def checkout_changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two ``checkout_state``s, as ``git status`` would show it."""
    changes = []
    for path in sorted(before.keys() | after.keys()):
        if before.get(path) != after.get(path):
            status = after[path][0] if path in after else "gone, was " + before[path][0]
            changes.append(f"{status} {path}")
    return changes


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def _is_worker(session: pytest.Session) -> bool:
    return hasattr(session.config, "workerinput")


def _fail(session: pytest.Session, what: str, lines: list[str]) -> None:
    print(f"\n{what}:\n" + "\n".join(lines), flush=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
