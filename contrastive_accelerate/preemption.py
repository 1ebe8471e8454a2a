"""Stop at a step boundary on SIGTERM or SIGINT, so that a checkpoint can be written.

Cluster schedulers send SIGTERM some time before they kill a job; Ctrl-C sends
SIGINT. ``StopSignals`` turns the first one into a request that the training loop
reads at its next step boundary (where all ranks agree to stop, save and exit
with ``EXIT_PREEMPTED``). A second signal ends the process at once, unsaved.

A launcher passes a signal on to its workers: torchrun, which ``accelerate launch``
uses for several processes, forwards the SIGTERM or SIGINT it receives, so a
signal sent to the whole process group reaches each worker twice within
milliseconds. A repeat within ``REPEAT_WINDOW_S`` counts as the same signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import NoReturn

#: sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": the run
#: saved a checkpoint on a signal and can be requeued with ``--resume-from latest``.
EXIT_PREEMPTED = 75
REPEAT_WINDOW_S = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager: while active, SIGTERM/SIGINT set ``requested`` instead of killing.

    Handlers can only be installed from the main thread; elsewhere (a trainer run in
    a worker thread of a larger program) the process keeps its own handlers and
    ``requested`` stays ``None``. The previous handlers are restored on exit unless a
    signal arrived: then the process is stopping, and these handlers stay to the end.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.requested is not None:
            # The process is on its way out: keep treating a forwarded copy as the same
            # signal (it may land after the loop has stopped) and a later one as "now".
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._first_at = name, now
            _say(f"received {name}: stopping after the current step to save a checkpoint")
        elif now - self._first_at > REPEAT_WINDOW_S:
            _say(f"received {name} again: stopping now, without a checkpoint")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """Ignore SIGTERM and SIGINT from now on. As a DataLoader ``worker_init_fn``: a signal
    sent to the whole process group must not kill the loader's workers before the main
    process has saved (it ends them itself). In a process that has saved and is exiting:
    a forwarded copy must not turn the exit code into a death by signal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def exit_preempted() -> NoReturn:
    """Exit with ``EXIT_PREEMPTED`` once the checkpoint is written; a launcher's forwarded
    copy of the signal must not turn this exit into a death by signal."""
    ignore_stop_signals()
    sys.exit(EXIT_PREEMPTED)


def _say(message: str) -> None:
    os.write(2, f"{message}\n".encode())  # async-signal-safe, and one write per line
