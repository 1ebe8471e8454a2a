"""Memory measured in a process of its own: its RSS high-water mark (``VmHWM``) is its own,
where ``ru_maxrss`` would be inherited from the parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def memory_status_bytes(field: str) -> int:
    """``VmRSS``, ``VmHWM``, ... of this process, in bytes (Linux)."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def in_fresh_process(
    module: str,
    function: str,
    *args: Any,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """``module.function(*args)`` (plain literals in, JSON out) in a new interpreter with
    ``env`` added to this one's environment; its result, or ``{"error": the last line of
    its stderr}`` when it fails."""
    code = f"import json, {module} as m; print(json.dumps(m.{function}(*{args!r})))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])
