"""Running a llama.cpp program to completion: in its own process group (ended whole past the time limit, and dying
with us: PR_SET_PDEATHSIG), stdout and stderr to files, GPU memory sampled meanwhile (runtime/gpumem.py), the host
peak RSS from wait4.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from planner.errors import InputError

from . import gpumem

@dataclass(frozen=True)
class RunResult:
    argv: tuple[str, ...]
    returncode: int                    # negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    host_peak_bytes: int               # the child's peak RSS (wait4 rusage)
    gpu_peak_bytes: dict[str, int]     # per CUDA device: peak in use minus the baseline before the start
    gpu_baseline_bytes: dict[str, int]
    gpu_samples: int
    vram_source: str                   # "nvml", "nvidia-smi" or "none"
    seen: str = ""                     # the machine's state at the end (load, GPU clocks, other GPU processes)


_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    _PRCTL = _LIBC.prctl if _LIBC is not None else None
except (OSError, AttributeError):
    _PRCTL = None


def die_with_parent() -> None:
    """In a child before exec (Linux): the kernel sends it SIGKILL when the thread that started it exits, so a
    killed or crashed engine leaves no llama.cpp process behind. A no-op elsewhere."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _child_setup() -> None:
    """In the child before exec: its own process group (we kill the group), and death with its parent."""
    os.setpgid(0, 0)
    die_with_parent()


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group that may be gone already (or no longer ours to signal)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap(pid: int, deadline: float | None) -> tuple[int, int, Any] | None:
    """wait4 the child until it exits (None if `deadline` passes first); polls, backing off to 50 ms."""
    delay = 0.002
    while True:
        wpid, status, ru = os.wait4(pid, os.WNOHANG)
        if wpid:
            return wpid, status, ru
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def run_process(argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float | None = None,
                sampler: gpumem.MemorySampler | None = None) -> RunResult:
    """Run argv to completion (or to the time limit: then the whole process group is ended), sampling GPU memory."""
    full_env = dict(os.environ if env is None else env)
    baseline = sampler.used() if sampler is not None else {}
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(list(argv), stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=full_env,
                                    preexec_fn=_child_setup)
        except OSError as e:
            raise InputError(f"cannot run {argv[0]}: {e.strerror or e}") from e
        timed_out, reaped, sampling = False, None, False
        try:
            if sampler is not None:
                sampler.start()
                sampling = True
            reaped = _reap(proc.pid, None if timeout_s is None else t0 + timeout_s)
            if reaped is None:
                timed_out = True
                killpg(proc.pid, signal.SIGTERM)
                reaped = _reap(proc.pid, time.monotonic() + 3.0)
                if reaped is None:
                    killpg(proc.pid, signal.SIGKILL)
                    reaped = _reap(proc.pid, None)
        finally:
            if reaped is None:                    # interrupted (KeyboardInterrupt): never leave it running
                killpg(proc.pid, signal.SIGKILL)
                reaped = _reap(proc.pid, None)
            killpg(proc.pid, signal.SIGKILL)     # whatever the child left behind in its group
            peak, n_samples = sampler.stop() if sampling else ({}, 0)
        wall = time.monotonic() - t0
        _, status, ru = reaped
        proc.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        out = fo.read().decode("utf-8", "replace")
        err = fe.read().decode("utf-8", "replace")
    delta = {i: max(b - baseline.get(i, 0), 0) for i, b in peak.items()}
    return RunResult(tuple(argv), proc.returncode, out, err, wall, timed_out, int(ru.ru_maxrss) * 1024,
                     gpumem.per_cuda_device(delta, full_env), gpumem.per_cuda_device(baseline, full_env), n_samples,
                     sampler.source if sampler is not None else "none", gpumem.machine_state(sampler))
