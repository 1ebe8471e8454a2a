"""The suite leaves the checkout and the machine as it found them (``session_checks``), and
runs where a user's earlier runs hold every default folder (``conftest.working_directory``).

The controls run the session checks in throwaway pytest sessions, each in a git checkout
of its own, so that the real suite stays green: a test that leaves a file in the checkout,
and one that leaves a sleeping child, each fail their session with the leftover named."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from session_checks import SESSION_MARK

from contrastive_accelerate.checkpoint import FINAL_DIR
from contrastive_accelerate.methods import METHODS

from launch import ENV, REPO, train_pooled

CLEAN = "def test_clean():\n    assert True\n"
LEAVES_A_FILE = """
from pathlib import Path

def test_leaves_a_file_in_the_checkout():
    Path("left-behind.txt").write_text("a run's output")
"""
LEAVES_A_PROCESS = """
import subprocess, sys

def test_leaves_a_sleeping_child():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # left-behind"])
"""


def _git(checkout: Path, *args: str) -> None:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(["git", *identity, "-C", str(checkout), *args], check=True,
                   capture_output=True, timeout=60)  # fmt: skip


def throwaway_session(root: Path, test_source: str) -> subprocess.CompletedProcess:
    """``python -m pytest -p session_checks`` on one test file committed to a new git
    checkout, under a session mark of its own; what is left of its processes is killed."""
    checkout = root / "checkout"
    checkout.mkdir()
    (checkout / "pytest.ini").write_text("[pytest]\n")
    (checkout / "test_throwaway.py").write_text(test_source)
    _git(checkout, "init", "-q")
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-q", "-m", "the checkout as the session finds it")
    mark = f"throwaway-{uuid.uuid4().hex}"
    command = [sys.executable, "-m", "pytest", "-p", "session_checks", "-p", "no:cacheprovider",
               "-p", "no:xdist", "--left-behind-grace", "2", "-q", "test_throwaway.py"]  # fmt: skip
    environment = {**ENV, SESSION_MARK: mark, "PYTHONPATH": str(REPO / "tests"),
                   "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    try:
        return subprocess.run(command, cwd=checkout, env=environment, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    finally:
        for process in psutil.process_iter():
            try:
                if process.environ().get(SESSION_MARK) == mark:
                    process.kill()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue


def test_a_session_that_leaves_nothing_passes(tmp_path):
    result = throwaway_session(tmp_path, CLEAN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "left behind" not in result.stdout and "changed the checkout" not in result.stdout


def test_control_a_file_left_in_the_checkout_fails_the_session_naming_it(tmp_path):
    result = throwaway_session(tmp_path, LEAVES_A_FILE)
    print(result.stdout[result.stdout.find("the tests changed") :])
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    assert "1 passed" in result.stdout  # the test passed: the session check failed it
    assert "the tests changed the checkout (git status):\n?? left-behind.txt" in result.stdout


def test_control_a_sleeping_child_left_alive_fails_the_session_naming_it(tmp_path):
    result = throwaway_session(tmp_path, LEAVES_A_PROCESS)
    print(result.stdout[result.stdout.find("processes left") :])
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "processes left behind by the tests:\n" in result.stdout
    assert "time.sleep(600)  # left-behind" in result.stdout


def test_the_tests_run_outside_the_checkout_where_every_default_folder_holds_a_run(
    working_directory,
):
    """Every test runs in ``working_directory``, and so does every trainer run it starts,
    pooled or launched; there, a run left at its default folder is refused, as in a user's
    checkout after the README's first command. So a test that passes here takes its output
    folder from its own temporary directory."""
    assert Path.cwd() == working_directory and not working_directory.is_relative_to(REPO)
    for method in ("simclr", "dino"):
        result = train_pooled(1, "--method", method, "--model", "mlp", "--max-steps", "1",
                              "--knn-k", "0", check=False)  # fmt: skip
        assert result.returncode != 0
        assert f"'runs/{method}' already holds another run (final)" in result.stderr
    assert sorted(path.name for path in (working_directory / "runs").iterdir()) == sorted(METHODS)


def test_each_method_trains_into_its_own_default_folder(tmp_path, monkeypatch):
    """After the README's first command (a finished run in ``runs/simclr``), ``--method
    dino`` trains into ``runs/dino``; the SimCLR run is left as it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "simclr" / FINAL_DIR).mkdir(parents=True)
    result = train_pooled(1, "--method", "dino", "--model", "mlp", "--max-steps", "1",
                          "--knn-k", "0")  # fmt: skip
    assert result.returncode == 0
    assert (tmp_path / "runs" / "dino" / FINAL_DIR / "model.safetensors").is_file()
    assert [path.name for path in (tmp_path / "runs" / "simclr").iterdir()] == [FINAL_DIR]
