"""Tune workers: each tune the server starts is `offload-tuner tune ... --json` in its own process (the command line
TuneRequest.to_argv renders, run by the CLI; its own session), so a worker that is killed or crashes costs only that
job: the server notes how it ended and the study keeps every finished trial (Optuna's heartbeat fails the trial it
left running). A worker dies with the server, kill -9 included: the kernel sends it SIGINT, the stop that keeps its
study resumable (planner/children.py; started on the event loop's thread, which lives as long as the server)."""
from __future__ import annotations

import contextlib

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner import children
from ..app.requests import ServerConfig, TuneRequest
from .security import Busy, Conflict, NotFound

STOP_GRACE_S = 0.6       # SIGINT first (tune stops at its next safe point), then SIGKILL of its process group
KILL_WAIT_S = 0.3        # a stop is over, the worker gone, within STOP_GRACE_S + KILL_WAIT_S


@dataclass
class Job:
    id: str
    study: str
    storage: str
    argv: list[str]
    proc: subprocess.Popen
    log_path: Path
    out_path: Path
    started: float = field(default_factory=time.time)
    state: str = "running"          # running, done, failed, stopped
    returncode: int | None = None
    error: str = ""
    ended: float | None = None
    stop_requested: bool = False
    killed: bool = False            # the stop's SIGINT was not taken in time: SIGKILL

    def refresh(self) -> None:
        if self.state != "running":
            return
        rc = self.proc.poll()
        if rc is None:
            return
        self.returncode, self.ended = rc, time.time()
        if rc == 0:
            self.state = "done"
        elif self.stop_requested:
            self.state = "stopped"
            if self.killed:
                self.error = ("stopped by SIGKILL (it did not stop at a safe point within a second); every finished "
                              "trial is kept: start the same tune to resume it")
        elif rc < 0:
            self.state = "failed"
            self.error = (f"the tune worker died (signal {-rc}); the study keeps every finished trial: start the "
                          "same tune to resume it")
        else:
            self.state = "failed"
            self.error = self._last_error()

    def _last_error(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        errs = [ln for ln in lines if ln.startswith("offload-tuner:")]
        return (errs or lines or [f"the tune worker exited with status {self.returncode}"])[-1][:500]

    def result(self) -> Any:
        """tune --json's output, once the worker has finished well."""
        if self.state != "done":
            return None
        try:
            return json.loads(self.out_path.read_text())
        except (OSError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        self.refresh()
        from tuner.storage import shown_url          # a storage URL is shown without its password
        command = ["offload-tuner", *(shown_url(a) if "://" in a else a for a in self.argv)]
        return {"id": self.id, "study": self.study, "storage": shown_url(self.storage), "state": self.state,
                "pid": self.proc.pid, "command": command, "started": self.started,
                "ended": self.ended, "returncode": self.returncode, "error": self.error}


class Jobs:
    def __init__(self, config: ServerConfig, state_dir: Path):
        self.config = config
        self.state_dir = state_dir
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def running(self) -> list[Job]:
        for j in self._jobs.values():
            j.refresh()
        return [j for j in self._jobs.values() if j.state == "running"]

    def all(self) -> list[Job]:
        return list(self._jobs.values())

    def get(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"no tune {job_id!r} on this server")
        job.refresh()
        return job

    def for_study(self, study: str) -> Job | None:
        return next((j for j in reversed(self.running()) if j.study == study), None)

    def start(self, opts: TuneRequest, study: str, storage: str) -> Job:
        """A worker running `offload-tuner tune` with OPTS (SIGINT stops it, resumable: stop())."""
        argv = opts.to_argv()
        with self._lock:               # the bound and the one-job-per-study rule hold under concurrent requests
            running = self.running()
            if len(running) >= self.config.max_tunes:
                raise Busy(f"{len(running)} tune(s) running already and this server runs at most "
                           f"{self.config.max_tunes} at once; wait for one or stop it")
            if any(j.study == study for j in running):
                raise Conflict(f"study {study!r} has a tune running already (one worker per study here)")
            job_id = uuid.uuid4().hex[:12]
            log_path = self.state_dir / f"{job_id}.log"
            out_path = self.state_dir / f"{job_id}.json"
            cmd = [sys.executable, "-m", "offload_tuner.cli", *argv]
            env = dict(os.environ)
            # the worker imports this very package, wherever the server was started from
            pkg_root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join([pkg_root, *filter(None, [env.get("PYTHONPATH")])])
            with open(log_path, "wb") as err, open(out_path, "wb") as out:
                proc = children.popen(cmd, death_signal=signal.SIGINT, cwd=self.config.workdir, stdout=out,
                                      stderr=err, stdin=subprocess.DEVNULL, env=env)
            job = Job(job_id, study, storage, argv, proc, log_path, out_path)
            self._jobs[job_id] = job
            return job

    def stop(self, job_id: str) -> Job:
        """Stop a tune within a second, whatever it is doing: SIGINT (tune's KeyboardInterrupt path: it stops at
        the next safe point, an engine run at once); a worker still there after STOP_GRACE_S (importing, building
        its pool, in Optuna's bookkeeping) is killed with its process group (an engine's llama.cpp child has its own
        group and dies with the worker: planner/children.py). Either way
        every finished trial is in the storage (each is committed as it ends) and the study resumes; a trial
        the kill cut short is failed by Optuna's heartbeat and run again on resume. Blocks up to about a second
        (the service calls it from a worker thread)."""
        job = self.get(job_id)
        if job.state != "running":
            return job
        job.stop_requested = True
        with contextlib.suppress(ProcessLookupError):
            job.proc.send_signal(signal.SIGINT)
        try:
            job.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill(job)
        job.refresh()
        return job

    @staticmethod
    def _kill(job: Job) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(job.proc.pid, signal.SIGKILL)      # its own session (planner/children.py)
        with contextlib.suppress(ProcessLookupError):
            job.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.proc.wait(timeout=KILL_WAIT_S)
        job.killed = True

    def shutdown(self, wait_s: float = 5.0) -> None:
        """Stop every worker with the server (SIGINT, then SIGKILL)."""
        live = self.running()
        for j in live:
            j.stop_requested = True
            with contextlib.suppress(ProcessLookupError):
                j.proc.send_signal(signal.SIGINT)
        deadline = time.time() + wait_s
        for j in live:
            try:
                j.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self._kill(j)
                j.proc.wait()
            j.refresh()
