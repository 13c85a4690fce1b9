"""One llama-server as a process: which program it is (`find_server`, `server_info` from its --help; `server_binary`
the tests' CPU build), a free loopback port, and `ServerProcess`: started in its own session (dying with us), polled
until GET /health answers, its peak RSS watched, its exit explained from its log, and always stopped with its whole
process group. The replay over HTTP and the measurement are runtime/llamaserver.py's.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from planner import children
from planner.builds import Build
from planner.errors import InputError, OffloadTunerError

from .llamacpp_binary import FLAG_TOKEN, build_of_binary, find_program, list_devices
from .llamacpp_output import classify_failure

ENV_BINARY = "LLAMA_SERVER"
HOST = "127.0.0.1"
PROBE_TIMEOUT_S = 30.0
HEALTH_POLL_S = 0.05
IDLE_WAIT_S = 5.0           # before timed requests: how long to wait for their slots to be free
# mainline server-http.cpp "couldn't bind HTTP server socket"; ik server.cpp "couldn't bind to server socket"
_BIND_FAILED = re.compile(r"couldn't bind[^\n]*")
_REASON = re.compile(r"^\s*error\b|\berror:|\bfailed\b|couldn't|out of memory|GGML_ASSERT|\babort", re.I)


class ReplayError(OffloadTunerError):
    """A run that failed for a reason of the run itself; measure() turns it into Measurement.failed (kind ->
    raw["failure"]), so it never leaves the engine."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class ServerInfo:
    """What a llama-server binary is (from its --help and --version)."""
    path: Path
    build: Build
    flags: frozenset[str]             # every spelling its --help lists
    devices: dict[str, Any] | None    # what --list-devices lists (mainline), None when it cannot list them (ik)

    @property
    def dialect(self) -> str:
        return self.build.dialect

    @property
    def no_webui(self) -> tuple[str, ...]:
        """The flags that turn the web UI off: mainline --no-webui (common/arg.cpp), ik --webui none
        (common/common.cpp); () when the build has neither."""
        if "--no-webui" in self.flags:
            return ("--no-webui",)
        if "--webui" in self.flags and self.dialect == "ik":
            return ("--webui", "none")
        return ()


def find_server(explicit: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The llama-server to use: `explicit`, else $LLAMA_SERVER, else llama-server on PATH (InputError if none)."""
    return find_program("llama-server", "--llama-server", ENV_BINARY, explicit, env)


def server_info(path: str | Path) -> ServerInfo:
    """Probe a llama-server (cached per path, mtime and size)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    return _server_info(str(p), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=16)
def _server_info(path: str, mtime_ns: int, size: int) -> ServerInfo:
    try:
        r = children.run([path, "--help"], capture_output=True, text=True, errors="replace",
                           timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InputError(f"cannot run {path} --help: {e}") from e
    flags = frozenset(FLAG_TOKEN.findall(r.stdout + "\n" + r.stderr))
    if "--port" not in flags:
        raise InputError(f"{path} does not look like llama-server (its --help lists no --port)")
    return ServerInfo(Path(path), build_of_binary(path), flags, list_devices(path, flags))


def server_binary(dialect: str) -> Path:
    """The CPU llama-server the tests use, built once per machine: mainline from the pinned llama-cpp-python sdist
    (runtime/llamacpp_build.py), ik from the pinned tarballs (runtime/ik_build.py)."""
    if dialect == "mainline":
        from .llamacpp_build import SERVER, ensure_built
    elif dialect == "ik":
        from .ik_build import SERVER, ensure_built      # type: ignore[assignment]
    else:
        raise InputError(f"unknown dialect {dialect!r}; expected mainline or ik")
    return ensure_built((SERVER,))[SERVER]


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the kernel's pick; another process could take it before the server binds:
    the server then fails to bind and the run says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _vm_hwm_bytes(pid: int) -> int | None:
    """A process's peak resident memory (VmHWM of /proc/PID/status), None when unreadable (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the sockets listening on `port` (/proc/net/tcp and tcp6), None when /proc/net cannot be read."""
    found, readable = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            cols = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; column 9 the inode
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(cols[9])
    return found if readable else None


def owns_listener(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on `port` (Linux /proc); None when it cannot be told."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


class ServerProcess:
    """One llama-server: started, watched, stopped. Its output goes to `log_path`; `stop()` always ends the whole
    process group (SIGTERM, then SIGKILL after the grace period) and reaps it."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> None:
        self.argv, self.env, self.cwd, self.log_path = list(argv), dict(env), cwd, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_rss = 0
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            try:
                self.proc = children.popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd)
            except OSError as e:
                raise InputError(f"cannot run {self.argv[0]}: {e.strerror or e}") from e
        self._watcher = threading.Thread(target=self._watch, name="llama-server-rss", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        # VmHWM is a high-water mark, but /proc/PID goes when the process does: keep the last value read
        while not self._watch_stop.wait(0.2):
            self._read_rss()

    def _read_rss(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            hwm = _vm_hwm_bytes(self.proc.pid)
            if hwm is not None:
                self.peak_rss = max(self.peak_rss, hwm)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_healthy(self, port: int, timeout_s: float, run_deadline: float | None = None) -> None:
        """Return once GET /health answers 200 (ReplayError: it exited, `timeout_s` passed ("health_timeout") or
        the whole run's `run_deadline` did ("timeout"), or another process answers on the port)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise self.exit_error(mid_run=False)
            if _health(port) == 200:
                owner = owns_listener(self.pid, port)
                if owner is False:
                    raise ReplayError("port", f"port {port} answers /health, but not from this llama-server "
                                              f"(pid {self.pid}): another process holds the port")
                return
            now = time.monotonic()
            if run_deadline is not None and now >= run_deadline:
                raise ReplayError("timeout", "the run passed the engine's time limit while llama-server was starting")
            if now >= deadline:
                raise ReplayError("health_timeout", f"llama-server did not answer GET /health with 200 within "
                                                    f"{timeout_s:g} s")
            time.sleep(HEALTH_POLL_S)

    def exit_error(self, mid_run: bool) -> ReplayError:
        """Why the server exited (it has): the port, or what its log says (runtime/llamacpp_output.py). Kind
        "died" mid-run, else the log's kind (args, oom, load, context, crash, error)."""
        rc = self.proc.wait() if self.proc is not None else -1
        log = self.log_text()
        what = "died during the replay" if mid_run else "exited before it was ready"
        m = _BIND_FAILED.search(log)
        if m is not None and not mid_run:
            return ReplayError("port", f"llama-server {what}: {m.group(0).strip()} (the port is taken)")
        f = classify_failure(log, "", rc, have_results=False)
        kind, why = (f.kind, f.message) if f is not None else ("error", f"exit code {rc}")
        line = next(iter(reason_lines(log)), "")
        said = f" (its log: {line})" if line and line not in why else ""
        return ReplayError("died" if mid_run else kind, f"llama-server {what}: {why}{said}")

    def stop(self, grace_s: float) -> None:
        """End the process group: SIGTERM, SIGKILL after grace_s; reap. Safe to call twice."""
        self._watch_stop.set()
        proc = self.proc
        if proc is None:
            return
        try:
            self._read_rss()
            if proc.poll() is None:
                children.kill_group(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace_s)
        finally:                                   # a second Ctrl-C during the grace period still ends it
            children.kill_group(proc.pid)         # the server, or whatever it left in its group
            proc.wait()

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes().decode("utf-8", "replace")
        except OSError:
            return ""


def reason_lines(log: str, limit: int = 10) -> list[str]:
    """The log's lines that say what went wrong, first first: a refused flag is followed by pages of usage text
    (ik) that would push it out of the log's tail."""
    return [ln.strip()[:300] for ln in log.splitlines() if _REASON.search(ln)][:limit]


def _health(port: int) -> int | None:
    """The status of GET /health (None: nothing answered)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=0.5)     # a miss is retried; a dead server is seen
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def slots_idle(port: int, slots: Sequence[int]) -> bool | None:
    """Whether the slots are idle (GET /slots: mainline "is_processing", ik "state" 0), None when the server does not
    say (the endpoint is off, or answers something else)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=5.0)
    try:
        conn.request("GET", "/slots")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            return None
        states = {s.get("id"): s for s in json.loads(body) if isinstance(s, dict)}
    except (OSError, http.client.HTTPException, ValueError, TypeError):
        return None
    finally:
        conn.close()
    for i in slots:
        s = states.get(i)
        if s is None:
            return None
        busy = s["is_processing"] if "is_processing" in s else s.get("state", 0) != 0
        if busy:
            return False
    return True


def await_idle(port: int, slots: Sequence[int], deadline: float, limit_s: float = IDLE_WAIT_S) -> None:
    """Wait (at most limit_s) until the slots are idle: a server sends a request's last event before it frees the
    slot, and ik defers a request for a busy slot (examples/server/server-context.cpp process_single_task), so a
    timed request sent right after the warm-up could wait on that instead of being served."""
    end = min(deadline, time.monotonic() + limit_s)
    while slots_idle(port, slots) is False and time.monotonic() < end:
        time.sleep(0.01)
