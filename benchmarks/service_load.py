"""The service under load beside a running study: CLIENTS concurrent clients for SECONDS over plan, explain, the
study list, a study (its JSON and its page) and the study's live-update stream, against a real `offload-tuner
serve`, while a sim study (`offload-tuner tune preset:... --engine sim`, as a user starts it) writes to the same
storage; and the same study alone for the same time, before and after (the quiet runs: the mean of the two is
what the loaded run is held against, as the machine may change meanwhile).

Set-up: one folder, the server started there (`serve`, its defaults: SQLite files under studies/, 4 compute
threads); the study a CLI `tune` in the same folder (so studies/NAME.db, the file the server reads). Each run starts
a fresh study and its window opens at its first finished trial (the interpreter start and set-up left out);
trials finished inside the window are counted from the file (one SQL count at each end).

Clients: client i asks endpoint ENDPOINTS[i % 6] again THINK_S after each answer (a person or a script polling,
not a flood). Plan and explain bodies are drawn at random from PLAN_BODIES and EXPLAIN_BODIES, distinct questions
the server computes once each (offload_tuner/service/memo.py keeps the answers); the first answer to each body is also
reported apart ("cold"). A stream client reads the progress events for STREAM_S, then reconnects; its latency is
the time to the first event.

Figures: requests, errors (any status but 200, any transport error), p50/p95/p99 per endpoint, the server's peak
RSS (VmHWM), the study's trials in the window, loaded against quiet. Goals (issue 31) on 2 cores: 0 errors, p95
<= 1 s for explain and the study reads, <= 2 s for plan, the study slowed by < 20%.

Writes benchmarks/results/service_load.{json,md} (--out benchmarks/reported for the committed report).

    .venv/bin/python benchmarks/service_load.py [--clients 50] [--seconds 60] [--think 1.0] [--out DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ENDPOINTS = ("plan", "explain", "studies", "study", "study page", "events")
GOAL_P95_S = {"plan": 2.0, "explain": 1.0, "studies": 1.0, "study": 1.0, "study page": 1.0, "events": 1.0}
GOAL_SLOWDOWN = 0.20
STUDY_ARGS = ["preset:Qwen3-30B-A3B", "--engine", "sim", "--hardware", "rtx4090-ddr5", "--gpu", "16GiB",
              "--objective", "both", "--trials", "100000", "--no-report", "--quiet"]
PLAN_BODIES = [{"model": m, "gpu": g, "objective": o}
               for m in ("preset:Qwen3-30B-A3B", "preset:gpt-oss-120b", "preset:GLM-4.5-Air")
               for g in ("12GiB", "24GiB") for o in ("tg", "both")]
EXPLAIN_ARGS = (["-ngl", "99", "-ot", "exps=CPU", "-c", "8192"],
                ["-ngl", "99", "-ot", r"blk\.(1[0-9]|2[0-9])\.ffn_.*_exps=CPU", "-c", "16384", "-fa", "on"],
                ["-ngl", "99", "-cmoe", "-ub", "2048", "-b", "4096"])
EXPLAIN_BODIES = [{"model": m, "gpu": "24GiB", "args": list(a)}
                  for m in ("preset:Qwen3-30B-A3B", "preset:gpt-oss-120b", "preset:GLM-4.5-Air") for a in EXPLAIN_ARGS]
STREAM_S = 10.0
TIMEOUT_S = 30.0


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "offload_tuner.cli", *argv]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(workdir / "serve.log", "wb") as log:
        proc = subprocess.Popen(cli("serve", "--port", str(port)), cwd=workdir, env=env(), stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode}: {(workdir / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/api/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("serve did not answer in 120 s")


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def finished_trials(db: Path) -> int:
    """Trials of the file's study that finished (COMPLETE, FAIL or PRUNED): one read-only count."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
            return con.execute("SELECT count(*) FROM trials WHERE state IN ('COMPLETE', 'FAIL', 'PRUNED')"
                               ).fetchone()[0]
    except sqlite3.Error:        # not created yet
        return 0


def start_study(workdir: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """`offload-tuner tune ... --study NAME` in WORKDIR, returned once its first trial has finished."""
    db = workdir / "studies" / f"{name}.db"
    with open(workdir / f"tune-{name}.log", "wb") as log:
        proc = subprocess.Popen(cli("tune", *STUDY_ARGS, "--study", name), cwd=workdir, env=env(),
                                stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 300
    while finished_trials(db) < 1:
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise RuntimeError(f"tune {name} did not finish a trial: {(workdir / f'tune-{name}.log').read_text()}")
        time.sleep(0.2)
    return proc, db


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident memory (VmHWM); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_s(pid: int) -> float:
    """CPU seconds the process has used (user + system); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def children(pid: int) -> list[int]:
    """The server's own processes: its plan/explain workers (offload_tuner/service/workers.py) and their tracker."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class Record:
    endpoint: str
    status: int | str
    latency_s: float
    cold: bool = False           # the first answer to its body


@dataclass
class Load:
    url: str
    study: str
    seconds: float
    think_s: float
    records: list[Record] = field(default_factory=list)
    asked: set = field(default_factory=set)

    async def run(self, clients: int) -> None:
        limits = httpx.Limits(max_connections=clients + 5, max_keepalive_connections=clients + 5)
        async with httpx.AsyncClient(base_url=self.url, timeout=TIMEOUT_S, limits=limits) as c:
            deadline = time.monotonic() + self.seconds
            await asyncio.gather(*(self.client(c, i, deadline) for i in range(clients)))

    async def client(self, c: httpx.AsyncClient, i: int, deadline: float) -> None:
        endpoint, rng = ENDPOINTS[i % len(ENDPOINTS)], random.Random(i)
        await asyncio.sleep(rng.random() * self.think_s)          # the clients do not all start in the same instant
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            cold, first_event_s = False, None
            try:
                if endpoint == "events":
                    status, first_event_s = await self.stream(c, min(STREAM_S, deadline - time.monotonic()), t0)
                else:
                    method, path, body = self.request(endpoint, rng)
                    key = json.dumps(body, sort_keys=True) if body else None
                    cold = key is not None and key not in self.asked
                    self.asked.add(key)
                    r = await c.request(method, path, json=body)
                    status = r.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            latency = first_event_s if endpoint == "events" and status == 200 else time.perf_counter() - t0
            self.records.append(Record(endpoint, status, latency, cold))
            await asyncio.sleep(self.think_s)

    def request(self, endpoint: str, rng: random.Random) -> tuple[str, str, dict | None]:
        if endpoint == "plan":
            return "POST", "/api/plan", rng.choice(PLAN_BODIES)
        if endpoint == "explain":
            return "POST", "/api/explain", rng.choice(EXPLAIN_BODIES)
        return "GET", {"studies": "/api/studies", "study": f"/api/studies/{self.study}",
                       "study page": f"/studies/{self.study}"}[endpoint], None

    async def stream(self, c: httpx.AsyncClient, for_s: float, t0: float) -> tuple[int | str, float | None]:
        """Read the study's progress events for FOR_S: the status and the time to the first event."""
        first = None
        async with c.stream("GET", f"/api/studies/{self.study}/events") as r:
            if r.status_code != 200:
                return r.status_code, None
            end = time.monotonic() + for_s
            async for line in r.aiter_lines():
                if line.startswith("event: progress") and first is None:
                    first = time.perf_counter() - t0
                if time.monotonic() > end:
                    break
        return (200, first) if first is not None else ("no event", None)


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(records: list[Record]) -> dict[str, dict]:
    out = {}
    for endpoint in ENDPOINTS:
        rs = [r for r in records if r.endpoint == endpoint]
        ok = [r.latency_s for r in rs if r.status == 200]
        cold = [r.latency_s for r in rs if r.status == 200 and r.cold]
        out[endpoint] = {"requests": len(rs), "errors": sum(r.status != 200 for r in rs),
                         "error_kinds": sorted({str(r.status) for r in rs if r.status != 200}),
                         "p50_s": pct(ok, 50), "p95_s": pct(ok, 95), "p99_s": pct(ok, 99),
                         "max_s": max(ok, default=None),
                         "cold": len(cold), "cold_p95_s": pct(cold, 95), "goal_p95_s": GOAL_P95_S[endpoint]}
    return out


def measure(workdir: Path, clients: int, seconds: float, think_s: float) -> dict:
    """The quiet run, then the loaded one, in WORKDIR; the figures."""
    (workdir / "studies").mkdir(parents=True, exist_ok=True)
    server, url = start_server(workdir)
    try:
        rss_idle = peak_rss_bytes(server.pid)
        quiet = study_window(workdir, "quiet", seconds, None)
        load = Load(url, "loaded", seconds, think_s)
        cpu = {}

        def during() -> None:       # the load, and the CPU each side used meanwhile
            procs = {"server": [server.pid], "workers": children(server.pid)}
            before = {k: sum(cpu_s(p) for p in ps) for k, ps in procs.items()}
            clients_before = time.process_time()
            asyncio.run(load.run(clients))
            cpu.update({f"{k}_cpu_s": round(sum(cpu_s(p) for p in ps) - before[k], 1) for k, ps in procs.items()})
            cpu["clients_cpu_s"] = round(time.process_time() - clients_before, 1)
        loaded = study_window(workdir, "loaded", seconds, during)
        quiet_after = study_window(workdir, "quiet-after", seconds, None)      # the machine may have changed
        health = httpx.get(url + "/api/health", timeout=TIMEOUT_S).json()
        rss_peak = peak_rss_bytes(server.pid)
        workers_peak = sum(peak_rss_bytes(c) for c in children(server.pid))
    finally:
        stop(server, signal.SIGTERM)
    log = (workdir / "serve.log").read_text(errors="replace")
    per = summary(load.records)
    quiet_rate = (quiet["rate_per_s"] + quiet_after["rate_per_s"]) / 2
    slowdown = 1 - loaded["rate_per_s"] / quiet_rate if quiet_rate else None
    return {"clients": clients, "seconds": seconds, "think_s": think_s, "endpoints": per,
            "requests": sum(e["requests"] for e in per.values()), "errors": sum(e["errors"] for e in per.values()),
            "distinct_bodies": {"plan": len(PLAN_BODIES), "explain": len(EXPLAIN_BODIES)},
            "answers_kept": health.get("answers_kept"), "server_rss_idle_bytes": rss_idle,
            "server_rss_peak_bytes": rss_peak, "workers_rss_peak_bytes": workers_peak, "study_quiet": quiet,
            "study_loaded": loaded, "study_quiet_after": quiet_after,
            "study_slowdown": slowdown, "server_tracebacks": log.count("Traceback"), "cpu_under_load": cpu}


def study_window(workdir: Path, name: str, seconds: float, during) -> dict:
    """Trials study NAME finishes in a window of SECONDS from its first finished trial, while during() runs."""
    proc, db = start_study(workdir, name)
    try:
        n0, t0 = finished_trials(db), time.perf_counter()
        if during is not None:
            during()
        rest = seconds - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        n1, wall = finished_trials(db), time.perf_counter() - t0
        tune_cpu = cpu_s(proc.pid)
    finally:
        stop(proc)
    return {"trials": n1 - n0, "window_s": round(wall, 2), "rate_per_s": (n1 - n0) / wall,
            "tune_cpu_s_since_start": round(tune_cpu, 1)}


def machine() -> dict:
    load1, load5, load15 = os.getloadavg()
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "loadavg_at_end": [round(load1, 2), round(load5, 2), round(load15, 2)]}


def markdown(f: dict) -> str:
    def s(v):
        return "-" if v is None else f"{v:.3f}"
    q, ld, qa = f["study_quiet"], f["study_loaded"], f["study_quiet_after"]
    lines = ["# Service under load beside a running study", "",
             f"{f['clients']} clients for {f['seconds']:.0f} s (each asks again {f['think_s']} s after an answer) "
             "over plan, explain, the study list, a study (JSON and page) and its event stream, against "
             "`offload-tuner serve` while a sim study (`tune preset:Qwen3-30B-A3B --engine sim`) writes to the "
             "same SQLite storage. Plan and explain bodies drawn from "
             f"{f['distinct_bodies']['plan']} and {f['distinct_bodies']['explain']} distinct questions; cold: the "
             "first answer to each. Set-up in the docstring of benchmarks/service_load.py.", "",
             f"Machine: {f['machine']}.", "",
             "| endpoint | requests | errors | p50 s | p95 s | p99 s | max s | cold | cold p95 s | goal p95 s | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in f["endpoints"].items():
        ok = "yes" if e["errors"] == 0 and e["p95_s"] is not None and e["p95_s"] <= e["goal_p95_s"] else "NO"
        lines.append(f"| {name} | {e['requests']} | {e['errors']} | {s(e['p50_s'])} | {s(e['p95_s'])} | "
                     f"{s(e['p99_s'])} | {s(e['max_s'])} | {e['cold']} | {s(e['cold_p95_s'])} | {e['goal_p95_s']} | "
                     f"{ok} |")
    slow = f["study_slowdown"]
    lines += ["", f"CPU seconds used in the loaded window: {f['cpu_under_load']} (2 cores x the window's seconds "
                  "is what there was, for these, the study and anything else on the machine).",
              "", f"Requests: {f['requests']}, errors: {f['errors']}; the server's answer memo: "
                  f"{f['answers_kept']}; server tracebacks in its log: {f['server_tracebacks']}.", "",
              f"Server RSS: {f['server_rss_idle_bytes'] / 2**20:.0f} MiB idle, peak "
              f"{f['server_rss_peak_bytes'] / 2**20:.0f} MiB; its plan/explain worker processes: peak "
              f"{f['workers_rss_peak_bytes'] / 2**20:.0f} MiB together.", "",
              f"Study: {q['trials']} trials in {q['window_s']} s alone before, {ld['trials']} in {ld['window_s']} s "
              f"under load, {qa['trials']} in {qa['window_s']} s alone after: slowed by {100 * slow:.1f}% against "
              f"the mean rate alone (goal < {100 * GOAL_SLOWDOWN:.0f}%)." if slow is not None else
              "Study: no trial finished in the quiet window."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--think", type=float, default=1.0, help="seconds a client waits after an answer")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="service-load-") as tmp:
        figures = measure(Path(tmp), args.clients, args.seconds, args.think)
    figures["machine"] = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "service_load.json").write_text(json.dumps(figures, indent=2) + "\n")
    (out / "service_load.md").write_text(markdown(figures))
    print(markdown(figures))
    goals = figures["errors"] == 0 and all(e["p95_s"] is not None and e["p95_s"] <= e["goal_p95_s"]
                                           for e in figures["endpoints"].values()) \
        and figures["study_slowdown"] is not None and figures["study_slowdown"] < GOAL_SLOWDOWN
    return 0 if goals else 1


if __name__ == "__main__":
    sys.exit(main())
