"""The command line's logging: one handler on stderr, configured once per `main` from -v / -q.

The library (planner/, tuner/, runtime/, offload_tuner/) logs through `logging.getLogger(__name__)` and never
prints; the CLI prints results on stdout and sends its progress lines (a tune's start, `run`'s "measuring", a
build) through logging too, so -q silences them all. An INFO line is written as it is (the progress lines users
read); a warning or an error as `offload-tuner: WARNING: ...`, a debug line (-v) with the logger's name. Other
packages' loggers stay at WARNING whatever -v says."""
from __future__ import annotations

import logging
import sys

OURS = ("planner", "tuner", "runtime", "offload_tuner")   # the loggers -v / -q set; the rest keep the root's WARNING


class _Stderr(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record comes (pytest's capture swaps it between calls)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property               # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.INFO:
            return text
        if record.levelno < logging.INFO:
            return f"offload-tuner: DEBUG: {record.name}: {text}"
        return f"offload-tuner: {record.levelname}: {text}"


_handler: logging.Handler | None = None


def configure(level: int) -> None:
    """Our loggers at LEVEL (DEBUG with -v, INFO by default, WARNING with -q), through one stderr handler on the
    root logger (installed once, however many times main runs in one process; the root's own level, WARNING,
    still holds other packages' loggers)."""
    global _handler
    root = logging.getLogger()
    if _handler is None:
        _handler = _Stderr()
        _handler.setFormatter(_Format("%(message)s"))
        root.addHandler(_handler)
    for name in OURS:
        logging.getLogger(name).setLevel(level)


def level(verbose: bool, quiet: bool) -> int:
    return logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO


def shown(lvl: int = logging.INFO) -> bool:
    """Whether a line at LVL from the CLI would be shown (a progress bar is shown only where INFO lines are)."""
    return logging.getLogger("offload_tuner.cli").isEnabledFor(lvl)
