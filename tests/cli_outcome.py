"""Run the CLI in this process and classify what happened: exit 0, a clean error (exit 2, one line starting
`offload-tuner: error:`), or anything else (a traceback, another exit code, several lines, a hang)."""
from __future__ import annotations

import contextlib
import io
import signal
import traceback
from dataclasses import dataclass

from offload_tuner import cli


class _Hang(Exception):
    pass


@dataclass(frozen=True)
class Outcome:
    kind: str            # ok, error, traceback, hang, bad_exit, multiline
    rc: int | None
    stderr: str

    @property
    def clean(self) -> bool:
        return self.kind in ("ok", "error")


def _alarm(signum, frame):
    raise _Hang()


def run_cli(argv: list[str], time_limit_s: int = 30) -> Outcome:
    err, out = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(time_limit_s)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    except _Hang:
        return Outcome("hang", None, err.getvalue())
    except BaseException:             # noqa: BLE001 - anything escaping main() is what we look for
        return Outcome("traceback", None, traceback.format_exc())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    text = err.getvalue().strip()
    if rc == 0:
        return Outcome("ok", rc, text)
    if rc != 2:
        return Outcome("bad_exit", rc, text)
    lines = [ln for ln in text.splitlines() if ln.startswith("offload-tuner: error:") or not ln.startswith("#")]
    if len(lines) != 1 or not lines[0].startswith("offload-tuner: error:"):
        return Outcome("multiline", rc, text)
    return Outcome("error", rc, text)
