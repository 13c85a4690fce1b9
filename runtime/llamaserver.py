"""The llamaserver engine: start the llama-server command a plan emits (mainline or ik_llama.cpp) on a loopback port,
replay the user's Workload over HTTP, measure, stop the server.

    engine = LlamaServerEngine()                   # binary=PATH, else $LLAMA_SERVER, else llama-server on PATH
    m = engine.measure_workload(inv, plan, planner.workload.preset("chat"))
    m.raw["mean_request_s"], m.raw["classes"]      # the workload's objective, one row per request class
    engine.measure(inv, plan, BenchRun(512, 128, 4096))   # one request class: 512 new, 4096 cached, 128 out

How a run goes (contract: planner/engine_contract.py; the server facts it relies on: docs/llamacpp.md section 12):
1. The command: the plan with -c = workload.ctx (slots x the longest request) and -np = workload.slots, rendered
   for llama-server by planner.flags for the binary's build, plus --host 127.0.0.1 --port P (a free loopback port)
   and no web UI. Nothing else is added: the server runs as the user would run it (prompt cache on by default).
2. The server (runtime/server_process.py) starts in its own session (so its process group can be killed whole, and
   a Ctrl-C at the terminal reaches us, not it) and dies with us (PR_SET_PDEATHSIG); its output goes to a log file
   in a temporary folder, also its working folder (ik writes llama.log there). We poll GET /health until it answers
   200 while watching that the process lives, then check (Linux) that the listening socket is the server's own.
3. The replay: one untimed request first (`prime`: first-use costs out of the timings), then class by class:
   `in_flight` threads, thread i on slot i (`id_slot`). A class with cached tokens first sends, untimed, its
   prefix alone (n_predict 0) to each slot (a class's prefix grows the one its slot holds from the class before,
   as an agent's history or a chat's turns grow: only the difference is prefilled), before each repetition (the
   served stage times a class once: once per server start); once the slots are idle
   (GET /slots) the timed requests go out together: the same prefix plus `new_tokens` fresh token ids,
   n_predict = gen_tokens, ignore_eos, temperature 0, streamed. Prompts are token-id lists (exact counts); every
   fresh run of ids starts with an id that recent runs did not start with, so it never continues what a slot holds
   by chance. Per request: time to the first streamed event and to the last on our clock (the load is timed
   apart, ready_s: start to /health 200, never in a request); prompt_n/prompt_ms and predicted_n/predicted_ms from
   the server's `timings`. Each class runs `repetitions` times (default 2; the served stage: 1, its rounds give the
   spread); its row holds the medians.
4. The server is always stopped (SIGTERM to its group, SIGKILL after `stop_grace_s`), also on KeyboardInterrupt.
peak_bytes: GPU memory sampled during the run (runtime/gpumem.py, baseline subtracted; empty without a GPU);
host_bytes: the server's VmHWM from /proc (its peak resident memory).
Failures (Measurement.failed; raw["failure"], raw["log_reasons"], raw["log_tail"]): a server that exits before it is
ready is args / oom / load / context / crash / error as its log says (runtime/llamacpp_output.py), or "port" (taken);
then "health_timeout", "died" (mid-replay), "request" (an HTTP or server error), "timeout" (past `timeout_s`).
"""
from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from planner.errors import FlagError, InputError
from planner.flags import render
from planner.flags.common import shell_join
from planner.model import ModelInventory
from planner.plan import Plan
from planner.workload import RequestClass, Workload

from . import gpumem
from planner.engine_contract import BenchRun, Engine, Measurement
from .llamacpp_binary import check_devices, device_args
from .llamacpp_output import tail
from .server_process import (
    HOST, ReplayError, ServerInfo, ServerProcess, await_idle, find_server, free_port, reason_lines, server_info,
)

LOG_TAIL_CHARS = 3000
PRIME_TOKENS = 512          # the untimed first request's prompt, at most
DEATH_WAIT_S = 5.0          # a failed request waits this long for the server to exit before it is called the cause
# flags the engine sets itself in a hand-made command line (serve_args): value-taking, dropped with their value
_OWN_FLAGS = frozenset({"--host", "--port"})


# ---- one request -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestResult:
    """One timed /completion request: our clock, and the server's own timings (its `timings` object)."""
    ttft_s: float                     # request sent -> first streamed event (the first token)
    request_s: float                  # request sent -> the final event
    prompt_n: int                     # prompt tokens the server processed (cached ones not counted)
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    tokens_cached: int                # tokens the slot holds afterwards (mainline: prompt + generated; ik: n_past)
    cache_n: int | None               # prompt tokens taken from the cache (mainline timings.cache_n; ik: None)

    @property
    def pp_tps(self) -> float:
        return self.prompt_n / self.prompt_ms * 1e3 if self.prompt_n > 0 and self.prompt_ms > 0 else 0.0

    @property
    def tg_tps(self) -> float:
        """Generated tokens per second of generation time; 0.0 below 2 tokens: both builds charge the first token to
        the prompt, so one token has (next to) no generation time of its own."""
        return self.predicted_n / self.predicted_ms * 1e3 if self.predicted_n > 1 and self.predicted_ms > 0 else 0.0


def completion(port: int, body: Mapping[str, Any], timeout_s: float) -> RequestResult:
    """POST /completion with `"stream": true` and read the event stream to its final event (ReplayError on a
    refused connection, an HTTP error, an error event, or a stream that ends without a final event)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=max(timeout_s, 0.1))
    payload = json.dumps({**body, "stream": True}).encode()
    t0 = time.monotonic()
    first: float | None = None
    try:
        conn.request("POST", "/completion", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ReplayError("request", f"/completion answered HTTP {resp.status}: {_error_text(resp.read())}")
        while True:
            line = resp.readline()
            if not line:
                raise ReplayError("request", "/completion stream ended without a final event")
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            if not isinstance(event, dict):
                raise ReplayError("request", f"/completion sent an event that is not an object: {data[:200]!r}")
            if "error" in event:
                raise ReplayError("request", f"/completion: {_error_text(data)}")
            now = time.monotonic()
            if first is None:
                first = now
            if event.get("stop") is True:
                return _result(event, first - t0, now - t0)
    except TimeoutError as e:          # socket.timeout: nothing came
        raise ReplayError("timeout", f"/completion sent nothing for {timeout_s:g} s") from e
    except (OSError, http.client.HTTPException) as e:
        raise ReplayError("request", f"/completion failed: {type(e).__name__}: {e}") from e
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise ReplayError("request", f"/completion sent what we cannot read ({type(e).__name__}: {e})") from e
    finally:
        conn.close()


def _error_text(body: bytes) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    except ValueError:
        return body.decode("utf-8", "replace")[:300]


def _result(final: dict[str, Any], ttft_s: float, request_s: float) -> RequestResult:
    t = final["timings"]
    cache_n = t.get("cache_n")
    return RequestResult(ttft_s, request_s, int(t["prompt_n"]), float(t["prompt_ms"]), int(t["predicted_n"]),
                         float(t["predicted_ms"]), int(final.get("tokens_cached", 0)),
                         None if cache_n is None else int(cache_n))


# ---- the replay ------------------------------------------------------------------------------------------------------

class TokenSource:
    """Prompt token ids in [0, n_vocab). Each fresh run starts with the next id of a shuffled cycle over the
    vocabulary, so it differs from the start of the last n_vocab runs: a fresh run never continues a prompt that a
    slot (or mainline's RAM prompt cache) holds, and the server processes all of it."""

    def __init__(self, n_vocab: int, seed: int = 0) -> None:
        if n_vocab < 2:
            raise InputError(f"the model's vocabulary has {n_vocab} tokens; token-id prompts need at least 2")
        self.n_vocab = n_vocab
        self._rng = random.Random(seed)
        self._heads = itertools.cycle(self._rng.sample(range(n_vocab), n_vocab))

    def fresh(self, n: int) -> list[int]:
        if n <= 0:
            return []
        return [next(self._heads)] + [self._rng.randrange(self.n_vocab) for _ in range(n - 1)]


@dataclass(frozen=True)
class ClassResult:
    """A request class as replayed: its timed requests (in_flight x repetitions), and their medians."""
    request: RequestClass
    results: tuple[RequestResult, ...]

    def _median(self, values: Sequence[float]) -> float:
        return float(statistics.median(values)) if values else 0.0

    @property
    def ttft_s(self) -> float:
        return self._median([r.ttft_s for r in self.results])

    @property
    def request_s(self) -> float:
        return self._median([r.request_s for r in self.results])

    @property
    def pp_tps(self) -> float:
        return self._median([r.pp_tps for r in self.results if r.pp_tps > 0])

    @property
    def tg_tps(self) -> float:
        return self._median([r.tg_tps for r in self.results if r.tg_tps > 0])

    @property
    def prompt_n(self) -> int:
        return round(self._median([r.prompt_n for r in self.results]))

    @property
    def predicted_n(self) -> int:
        return round(self._median([r.predicted_n for r in self.results]))

    @property
    def cached_n(self) -> int:
        """Prompt tokens the server took from the cache: its cache_n (mainline), else the prompt minus prompt_n."""
        return round(self._median([r.cache_n if r.cache_n is not None else self.request.prompt_tokens - r.prompt_n
                                   for r in self.results]))

    @property
    def expected_prompt_n(self) -> int:
        """What the server should process: the new tokens (a prompt that is all cached still evaluates its last
        token for the logits, in both builds)."""
        return self.request.new_tokens or 1

    def row(self) -> dict[str, Any]:
        c = self.request
        return {"new_tokens": c.new_tokens, "cached_tokens": c.cached_tokens, "gen_tokens": c.gen_tokens,
                "weight": c.weight, "in_flight": c.in_flight, "requests": len(self.results),
                "ttft_s": round(self.ttft_s, 6), "request_s": round(self.request_s, 6),
                "pp_tps": round(self.pp_tps, 3), "tg_tps": round(self.tg_tps, 3), "prompt_n": self.prompt_n,
                "cached_n": self.cached_n, "predicted_n": self.predicted_n,
                "samples": [asdict(r) for r in self.results]}


def _gather(jobs: Sequence[Callable[[], RequestResult]], server: ServerProcess, deadline: float
            ) -> list[RequestResult]:
    """Run the jobs at once, one thread each; the server's death or the deadline ends the wait (the threads are
    daemons and end when the server's sockets close)."""
    out: list[RequestResult | BaseException | None] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            out[i] = jobs[i]()
        except BaseException as e:           # handed to the caller's thread
            out[i] = e
    threads = [threading.Thread(target=run, args=(i,), name=f"replay-{i}", daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    # until all are done, one fails (the run has failed: the others end when the server is stopped), the server
    # dies, or the time is up
    while (running := [t for t in threads if t.is_alive()]) and not any(isinstance(r, BaseException) for r in out):
        running[0].join(0.05)
        if not server.alive():
            raise server.exit_error(mid_run=True)
        if time.monotonic() > deadline:
            raise ReplayError("timeout", "the replay ran past the engine's time limit")
    errors = [r for r in out if isinstance(r, BaseException)]
    if errors:
        # a request cut off by a dying server often sees the closed socket before the process is gone (a crash
        # handler still printing its backtrace): give it a moment, so the run says the server died, and why
        end = time.monotonic() + DEATH_WAIT_S
        while (server.alive() and time.monotonic() < end and isinstance(errors[0], ReplayError)
               and errors[0].kind == "request"):
            time.sleep(0.05)
        if not server.alive():
            raise server.exit_error(mid_run=True)
        raise errors[0]
    return [r for r in out if isinstance(r, RequestResult)]


# ---- the engine ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerCommand:
    """The llama-server command a measurement starts, without --host/--port (added per run)."""
    program: str
    argv: tuple[str, ...]
    env: dict[str, str]
    notes: tuple[str, ...] = ()

    @property
    def shell(self) -> str:
        return shell_join([self.program, *self.argv], self.env)


def as_workload(workload: Workload | BenchRun) -> tuple[Workload, int | None]:
    """(the Workload to replay, its repetitions when the caller gave some): a BenchRun is one request class of
    n_prompt new tokens after `depth` cached ones, n_gen generated (TG only, with no depth: after a 1-token cached
    prompt, so no prompt is timed). TG then runs after depth + n_prompt tokens, as a server's would."""
    if isinstance(workload, Workload):
        return workload, None
    if isinstance(workload, BenchRun):
        cached = workload.depth if workload.n_prompt or workload.depth else 1
        return Workload("bench", (RequestClass(workload.n_prompt, cached, workload.n_gen),)), workload.repetitions
    raise InputError(f"the llamaserver engine replays a Workload or a BenchRun, not {type(workload).__name__}")


@dataclass
class LlamaServerEngine(Engine):
    """Measures plans by running llama-server and replaying a workload over HTTP. See the module docstring."""
    binary: str | Path | None = None
    model_path: str | Path | None = None     # default: the inventory's source file
    repetitions: int = 2                      # timed requests per class and slot (medians)
    timeout_s: float = 1800.0                 # the whole run: start, replay
    start_timeout_s: float = 600.0            # until /health answers 200 (loading a large model takes minutes)
    stop_grace_s: float = 5.0                 # SIGTERM to SIGKILL
    port: int = 0                             # 0: a free loopback port per run
    sample_interval_s: float = 0.05
    sample_vram: bool = True
    prime: bool = True                        # one untimed request before the replay (first-use costs out)
    progress: Callable[[str], None] | None = None   # hears "started pid N port P", "healthy", "class i/n rep r/R"
    seed: int = 0
    cpu_stand_in: bool = False                # every plan's tensors on the CPU (a CPU-only dry run of GPU plans)
    name: str = "llamaserver"
    path: Path = field(init=False)
    info: ServerInfo = field(init=False)
    _sampler: Any = field(init=False, default=None, repr=False)
    _sampler_checked: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        for what, v in (("timeout_s", self.timeout_s), ("start_timeout_s", self.start_timeout_s)):
            if v <= 0:
                raise InputError(f"{what} must be positive, got {v}")
        if isinstance(self.repetitions, bool) or not isinstance(self.repetitions, int) or self.repetitions < 1:
            raise InputError(f"repetitions must be an integer >= 1, got {self.repetitions!r}")
        if not 0 <= self.port < 65536:
            raise InputError(f"port {self.port}: give 1-65535, or 0 for a free one")
        self.path = find_server(self.binary)
        self.info = server_info(self.path)

    # -- pieces -------------------------------------------------------------------------------------------------------

    def sampler(self) -> gpumem.MemorySampler | None:
        if not self._sampler_checked:
            self._sampler = gpumem.detect(self.sample_interval_s) if self.sample_vram else None
            self._sampler_checked = True
        return self._sampler

    def _model(self, inv: ModelInventory) -> str:
        p = self.model_path if self.model_path is not None else inv.source
        if not p or not Path(p).is_file():
            raise InputError(f"the llamaserver engine needs the model file; {p or inv.name!r} is not one "
                             "(presets cannot run: write one with `offload-tuner synth`)")
        return str(p)

    @property
    def dialect(self) -> str:                     # type: ignore[override]
        return self.info.dialect

    def shell_command(self, inv: ModelInventory, plan: Plan, workload: Workload) -> str:  # type: ignore[override]
        return self.command(inv, plan, workload).shell

    def command(self, inv: ModelInventory, plan: Plan, workload: Workload) -> ServerCommand:
        """The llama-server command for the plan serving `workload` (InputError if this binary cannot run it)."""
        if plan.dialect != self.info.dialect:
            raise InputError(f"the plan is for {plan.dialect}, but {self.path} is a {self.info.dialect} build; "
                             f"re-plan with --dialect {self.info.dialect}")
        check_devices(plan, self.info.devices, self.path.name)
        p = replace(plan, knobs=replace(plan.knobs, n_ctx=workload.ctx, n_seq=workload.slots))
        try:
            rc = render(p, inv, "server", model_path=self._model(inv), build=self.info.build)
        except FlagError as e:
            raise InputError(f"cannot render the plan for {self.path.name}: {e}") from e
        notes = (*rc.notes, f"-c {workload.ctx} = {workload.slots} slot(s) x {workload.slot_ctx} tokens "
                            f"(workload {workload.name})")
        extra = (*device_args(plan, self.info.devices, self.info.flags), *self.info.no_webui)
        return ServerCommand(str(self.path), (*rc, *extra), dict(rc.env), notes)

    # -- measuring -----------------------------------------------------------------------------------------------------

    def measure(self, inv: ModelInventory, plan: Plan, workload: Workload | BenchRun) -> Measurement:
        """The Engine protocol's entry: a Workload is replayed as is, a BenchRun as one request class."""
        wl, reps = as_workload(workload)
        return self.measure_workload(inv, plan, wl, repetitions=reps)

    def measure_workload(self, inv: ModelInventory, plan: Plan, workload: Workload,
                         repetitions: int | None = None) -> Measurement:
        """Start the plan's llama-server, replay `workload`, stop it (the module docstring says how)."""
        if self.cpu_stand_in:       # the same knobs, every tensor on the CPU: the pipeline runs, not the GPU plan
            plan = replace(plan, assignment={n: "CPU" for n in plan.assignment})
        return self.run(self.command(inv, plan, workload), inv, workload, repetitions)

    def serve_args(self, inv: ModelInventory, args: Sequence[str], workload: Workload | BenchRun,
                   env: Mapping[str, str] | None = None, repetitions: int | None = None) -> Measurement:
        """Run a hand-made llama-server command line (`run -- <args>`, without the program) on the workload. Our
        --host/--port replace any given; -m (the model), -c and -np (the workload's) are added when missing; a
        given -np smaller than the workload's requests in flight is refused. `repetitions`: timed requests per
        class (None: a BenchRun's own, else the engine's)."""
        wl, reps = as_workload(workload)
        reps = repetitions if repetitions is not None else reps
        argv, notes, it = [], [], iter(args)
        for a in it:
            if a in _OWN_FLAGS:
                notes.append(f"{a} {next(it, '')} replaced by the engine's loopback port")
            else:
                argv.append(a)
        given = set(argv)
        if not given & {"-m", "--model"}:
            argv = ["-m", self._model(inv), *argv]
        if not given & {"-c", "--ctx-size"}:
            argv += ["-c", str(wl.ctx)]
        np_at = next((i for i, a in enumerate(argv) if a in ("-np", "--parallel")), None)
        if np_at is None:
            argv += ["-np", str(wl.slots)]
        else:
            try:
                n_slots = int(argv[np_at + 1])
            except (IndexError, ValueError):
                n_slots = wl.slots            # a bad value: the server's own parser says so
            if 0 < n_slots < wl.slots:
                raise InputError(f"-np {n_slots}: the workload has {wl.slots} requests in flight; give -np "
                                 f"{wl.slots} or more")
        argv += [a for a in self.info.no_webui if a not in given]
        return self.run(ServerCommand(str(self.path), tuple(argv), dict(env or {}), tuple(notes)), inv, wl, reps)

    def fit_reference(self, inv: ModelInventory, workload: Workload, budgets: Mapping[str, int],
                      ubatch: int = 512, kv_type: str | None = None, threads: int | None = None,
                      repetitions: int | None = None) -> Measurement:
        """llama-server's own fitting as a user runs it for this budget: `--fit on` (mainline; ik: `--fit`) at the
        workload's context and slots, told to leave free on each GPU what is free now minus the budget (mainline
        -fitt per GPU; ik --fit-margin, one value: the tightest GPU's), at `ubatch` (512 is the server's default;
        larger ones with -b at least as large). The budget is the tuner's per-GPU one; the measured peaks say what
        llama.cpp actually used. On a machine without GPUs the line runs without the fit (a CPU build's fit has
        no device memory to fit). `kv_type`: the KV cache's type for K and V (`-ctk`/`-ctv`, with flash attention,
        which a quantized V cache needs), as a user would add it to --fit after seeing a pick use it. `threads`: -t,
        when every contender is served at one thread count (None: the server's default). `repetitions`: timed
        requests per class (None: the engine's)."""
        sampler = self.sampler()
        free = gpumem.per_cuda_device(sampler.free(), os.environ) if sampler is not None else {}
        if sampler is not None and (unknown := sorted(set(budgets) - set(free))):
            raise InputError(f"--fit's budget names {unknown[0]}, but this machine's GPUs are "
                             f"{', '.join(sorted(free)) or 'none'}")
        margins = {d: max((free[d] - b) >> 20, 1) for d, b in budgets.items()} if sampler is not None else {}
        args: list[str] = []
        if margins:
            if self.info.dialect == "ik":
                args += ["--fit", "--fit-margin", str(min(margins.values()))]
            else:
                args += ["--fit", "on", "-fitt", ",".join(str(margins[d]) for d in sorted(margins))]
        elif self.info.dialect == "mainline":
            args += ["--fit", "off"]
        if ubatch != 512:
            args += ["-ub", str(ubatch), "-b", str(max(ubatch, 2048))]
        if kv_type is not None:
            args += ["-ctk", kv_type, "-ctv", kv_type, "-fa", "on"]
        if threads:
            args += ["-t", str(threads)]
        m = self.serve_args(inv, args, workload, repetitions=repetitions)
        m.raw["fit_free_bytes"] = free
        return m

    def run(self, cmd: ServerCommand, inv: ModelInventory, workload: Workload, repetitions: int | None = None
            ) -> Measurement:
        """Start `cmd` on a loopback port, replay, stop; a failure of the run is a failed Measurement."""
        reps = self.repetitions if repetitions is None else repetitions
        tokens = TokenSource(inv.hparams.n_vocab, self.seed)
        port = self.port or free_port()
        argv = [cmd.program, *cmd.argv, "--host", HOST, "--port", str(port)]
        env = {**os.environ, "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), **cmd.env}
        sampler = self.sampler()
        baseline = sampler.used() if sampler is not None else {}
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        results: list[ClassResult] = []
        failure: ReplayError | None = None
        ready_s = None
        with tempfile.TemporaryDirectory(prefix="llamaserver-") as tmp:
            server = ServerProcess(argv, env, Path(tmp), Path(tmp) / "server.log")
            sampling = False
            try:
                if sampler is not None:
                    sampler.start()
                    sampling = True
                server.start()
                self._say(f"started pid {server.pid} port {port}")
                try:
                    server.wait_healthy(port, self.start_timeout_s, deadline)
                    ready_s = time.monotonic() - t0
                    self._say("healthy")
                    self._replay(server, port, workload, reps, tokens, deadline, results)
                except ReplayError as e:
                    failure = e
            finally:
                server.stop(self.stop_grace_s)
                peak, n_samples = sampler.stop() if sampling else ({}, 0)
            log = server.log_text()
            returncode = server.returncode
        wall = time.monotonic() - t0
        delta = {i: max(b - baseline.get(i, 0), 0) for i, b in peak.items()}
        raw: dict[str, Any] = {
            "engine": self.name, "binary": str(self.path), "dialect": self.info.dialect,
            "build": self.info.build.describe(), "command": cmd.shell, "argv": list(cmd.argv), "env": dict(cmd.env),
            "notes": list(cmd.notes), "port": port, "workload": workload.to_dict(), "repetitions": reps,
            "ready_s": None if ready_s is None else round(ready_s, 3), "wall_s": round(wall, 3),
            "returncode": returncode, "vram_source": sampler.source if sampler is not None else "none",
            "vram_samples": n_samples, "vram_baseline_bytes": gpumem.per_cuda_device(baseline, env),
            "classes": [r.row() for r in results], "log_tail": tail(log, LOG_TAIL_CHARS),
        }
        peak_bytes = gpumem.per_cuda_device(delta, env)
        if failure is not None:
            raw["failure"] = failure.kind
            raw["log_reasons"] = reason_lines(log)
            return Measurement.failed(failure.message, peak_bytes=peak_bytes, host_bytes=server.peak_rss, raw=raw)
        return self._measurement(workload, results, peak_bytes, server.peak_rss, raw)

    def _say(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what)

    def _replay(self, server: ServerProcess, port: int, workload: Workload, reps: int, tokens: TokenSource,
                deadline: float, results: list[ClassResult]) -> None:
        """Each class in turn (module docstring, step 3); appends one ClassResult per class to `results`."""
        n = len(workload.classes)
        if self.prime:
            # the first real batch pays for first touches (mmapped weights paged in, thread pools and buffers set
            # up): a first-class-sized prompt (up to PRIME_TOKENS) and two generated tokens take them out of the
            # timings; its fresh ids match nothing later
            first = workload.classes[0]
            prime = tokens.fresh(min(max(first.new_tokens, 1), PRIME_TOKENS))
            _gather([self._job(port, prime, 2, 0, deadline)], server, deadline)
        held: dict[int, list[int]] = {}          # slot -> the prefix it was last warmed with
        for ci, c in enumerate(workload.classes):
            prefixes = [_grown(held.get(s, []), c.cached_tokens, tokens) for s in range(c.in_flight)]
            held.update(enumerate(prefixes))
            timed: list[RequestResult] = []
            for rep in range(reps):
                # before every repetition: after a timed request ik's slot did not always give back the whole
                # prefix (20 of 40 cached, 1 run in 3); the served stage times each class once, so once a start
                if c.cached_tokens:
                    warm = [self._job(port, prefixes[s], 0, s, deadline) for s in range(c.in_flight)]
                    _gather(warm, server, deadline)
                await_idle(port, range(c.in_flight), deadline)
                self._say(f"class {ci + 1}/{n} rep {rep + 1}/{reps}")
                jobs = [self._job(port, prefixes[s] + tokens.fresh(c.new_tokens), c.gen_tokens, s, deadline)
                        for s in range(c.in_flight)]
                timed += _gather(jobs, server, deadline)
            results.append(ClassResult(c, tuple(timed)))

    @staticmethod
    def _job(port: int, prompt: list[int], n_predict: int, slot: int, deadline: float
             ) -> Callable[[], RequestResult]:
        body = {"prompt": prompt, "n_predict": n_predict, "id_slot": slot, "cache_prompt": True,
                "ignore_eos": True, "temperature": 0.0}
        return lambda: completion(port, body, deadline - time.monotonic())

    def _measurement(self, workload: Workload, results: Sequence[ClassResult], peak_bytes: dict[str, int],
                     host_bytes: int, raw: dict[str, Any]) -> Measurement:
        by_class = {id(r.request): r for r in results}
        mean_s = workload.mean_request_s(lambda c: by_class[id(c)].request_s)
        notes = raw["notes"]
        for i, r in enumerate(results):
            if r.prompt_n != r.expected_prompt_n:
                notes.append(f"class {i + 1}: the server processed {r.prompt_n} prompt tokens, not "
                             f"{r.expected_prompt_n} (cached {r.cached_n} of {r.request.prompt_tokens})")
            if r.predicted_n != r.request.gen_tokens:     # n_predict 0 still samples one token, in both builds
                notes.append(f"class {i + 1}: the server generated {r.predicted_n} tokens, not "
                             f"{r.request.gen_tokens}")
        raw.update(mean_request_s=round(mean_s, 6),
                   tokens_per_s=round(workload.tokens_per_request() / mean_s, 3) if mean_s > 0 else 0.0,
                   ttft_s=round(_weighted(results, lambda r: r.ttft_s), 6),
                   ttft_max_s=round(max((r.ttft_s for r in results), default=0.0), 6))
        pp = _weighted([r for r in results if r.request.new_tokens > 0], lambda r: r.pp_tps)
        tg = _weighted([r for r in results if r.request.gen_tokens > 0], lambda r: r.tg_tps)
        return Measurement(pp_tps=pp, tg_tps=tg, peak_bytes=peak_bytes, host_bytes=host_bytes, raw=raw)


def _grown(held: list[int], n: int, tokens: TokenSource) -> list[int]:
    """A class's cached context of n tokens on a slot that was warmed with `held`: the same conversation grown (an
    agent's history, a chat's turns), so its warm request prefills only what is new; the timed request is the same
    as after a fresh prefix of n tokens, and a 235B model served on RAM-resident experts spends minutes less a run."""
    if not n:
        return []
    return held[:n] + tokens.fresh(n - len(held)) if held else tokens.fresh(n)


def _weighted(results: Sequence[ClassResult], value: Callable[[ClassResult], float]) -> float:
    """The classes' weighted mean of `value` over those that have one (> 0); 0.0 when none has."""
    have = [(r.request.weight, value(r)) for r in results if value(r) > 0]
    total = sum(w for w, _ in have)
    return sum(w * v for w, v in have) / total if total else 0.0


def from_options(opts: Any, hw: Any) -> LlamaServerEngine:
    """The registry's factory (planner/engine_registry.py): llama-server from the options (else $LLAMA_SERVER, else
    PATH)."""
    return LlamaServerEngine(binary=opts.llama_server, model_path=opts.model_path, timeout_s=opts.timeout_s,
                             cpu_stand_in=opts.cpu_stand_in)
