"""Counting the processes a killed program left running: the test starts the program with a mark in its
environment (every child inherits it), kills it, and looks for the mark in /proc/PID/environ (Linux)."""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

MARK_VAR = "OFFLOAD_TUNER_TEST_MARK"


def new_mark() -> dict[str, str]:
    """Environment entries that mark a program and its children."""
    return {MARK_VAR: uuid.uuid4().hex}


def marked(mark: dict[str, str]) -> dict[int, str]:
    """pid -> command line of the live processes carrying `mark` (zombies are dead: left out)."""
    needle = f"{MARK_VAR}={mark[MARK_VAR]}".encode()
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            out[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def survivors(mark: dict[str, str], wait_s: float = 10) -> dict[int, str]:
    """The marked processes still alive after up to `wait_s` seconds (a dying child takes a moment)."""
    deadline = time.monotonic() + wait_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_all(pids) -> None:
    """End what a failing test left behind (by pid, never by name)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
