"""Ctrl-C (SIGINT) that stops a study only where stopping is safe.

Python raises KeyboardInterrupt at whatever bytecode runs when the signal lands. In a study that may be inside
Optuna's own bookkeeping (its `tell` after a trial: optuna/study/_optimize.py `_run_trial` then fails with an
UnboundLocalError and a traceback) or half way through a storage write. So while a tune runs under `guard`:

- inside an engine run (`engine_run`, around every measurement) the interrupt is immediate: the run is
  abandoned (the engine kills its child process group), nothing of it is stored, the trial is failed by Optuna
  without a measurement, and a resumed study runs that config again;
- anywhere else it is noted (`pending`) and raised at the next safe point: the start of the next engine run, the
  end of the current trial (`Tuner.run`'s callback stops the study), or an explicit `check`.

Without `guard` (a library caller, a test) both helpers do nothing and SIGINT keeps Python's behaviour.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class SigintGuard:
    def __init__(self) -> None:
        self.installed = False
        self.pending = False
        self._immediate = False

    def _handler(self, signum, frame) -> None:
        if self._immediate:
            self._immediate = False          # one KeyboardInterrupt per run
            raise KeyboardInterrupt
        self.pending = True

    @contextlib.contextmanager
    def guard(self) -> Iterator[SigintGuard]:
        """Install the handler for the duration (main thread only: signals are delivered there)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = signal.signal(signal.SIGINT, self._handler)
        self.installed, self.pending, self._immediate = True, False, False
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, old)
            self.installed, self._immediate = False, False

    @contextlib.contextmanager
    def engine_run(self) -> Iterator[None]:
        """Around an engine run: an interrupt noted before it starts is raised now; one during it, at once."""
        if not self.installed:
            yield
            return
        self.check()
        self._immediate = True
        try:
            yield
        finally:
            self._immediate = False

    def check(self) -> None:
        """Raise the interrupt noted at an unsafe moment (call between stored steps)."""
        if self.installed and self.pending:
            self.pending = False
            raise KeyboardInterrupt


SIGINT = SigintGuard()      # one per process, like the signal itself
