"""Running a llama.cpp program to completion: in its own process group (ended whole past the time limit, and dying
with us: planner/children.py), stdout and stderr to files, GPU memory sampled meanwhile (runtime/gpumem.py), the host
peak RSS from wait4.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from planner import children
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
            proc = children.popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=full_env)
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
                children.kill_group(proc.pid, signal.SIGTERM)
                reaped = _reap(proc.pid, time.monotonic() + 3.0)
                if reaped is None:
                    children.kill_group(proc.pid)
                    reaped = _reap(proc.pid, None)
        finally:
            if reaped is None:                    # interrupted (KeyboardInterrupt): never leave it running
                children.kill_group(proc.pid)
                reaped = _reap(proc.pid, None)
            children.kill_group(proc.pid)        # whatever the child left behind in its group
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
