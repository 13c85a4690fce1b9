"""Ctrl-C (SIGINT), and SIGTERM and SIGHUP (what `timeout`, systemd, `docker stop` and a closed terminal send),
that stop a study only where stopping is safe. The three are one stop: the exception is `Stopped`, a
KeyboardInterrupt that says which signal came (the CLI exits 128 + its number: 130, 143, 129).

Python raises KeyboardInterrupt at whatever bytecode runs when the signal lands. In a study that may be inside
Optuna's own bookkeeping (its `tell` after a trial: optuna/study/_optimize.py `_run_trial` then fails with an
UnboundLocalError and a traceback) or half way through a storage write. So while a tune runs under `guard`:

- inside an engine run (`engine_run`, around every measurement and every reference, --fit included) the
  interrupt is immediate: the run is abandoned (the engine kills its child process group), nothing of it is
  stored, the trial is failed by Optuna without a measurement, and a resumed study runs that config again;
- anywhere else it is noted (`pending`) and raised at the next safe point: the start of the next engine run, the
  end of the current trial (`Tuner.run`'s callback stops the study), or an explicit `check`.

Without `guard` (a library caller, a test) both helpers do nothing and the signals keep their handlers. A signal
ignored when the guard starts (SIGHUP under nohup, SIGTERM set so by a supervisor) stays ignored.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """The stop a signal asked for (SIGINT, SIGTERM, SIGHUP): handled as Ctrl-C is, its number kept."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def signal_of(e: BaseException) -> int:
    """The signal a KeyboardInterrupt stands for: a Stopped's own, else SIGINT (Python's Ctrl-C)."""
    return getattr(e, "signum", int(signal.SIGINT))


def stop_now(signum, frame) -> None:
    """A handler for SIGTERM and SIGHUP outside a guard: stop as Ctrl-C stops (a KeyboardInterrupt, here)."""
    raise Stopped(signum)


class SigintGuard:
    def __init__(self) -> None:
        self.installed = False
        self.pending = False
        self.signum = int(signal.SIGINT)     # the last stop signal that came
        self._immediate = False

    def _handler(self, signum, frame) -> None:
        self.signum = int(signum)
        if self._immediate:
            self._immediate = False          # one KeyboardInterrupt per run
            raise Stopped(signum)
        self.pending = True

    @contextlib.contextmanager
    def guard(self) -> Iterator[SigintGuard]:
        """Install the handler for the duration (main thread only: signals are delivered there), for SIGINT and
        for SIGTERM and SIGHUP unless they are ignored."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            if s == signal.SIGINT or old[s] is not signal.SIG_IGN:
                signal.signal(s, self._handler)
        self.installed, self.pending, self._immediate = True, False, False
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
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
            raise Stopped(self.signum)


SIGINT = SigintGuard()      # one per process, like the signal itself
