"""The llamaserver engine against the real CPU llama-server builds (mainline from llama-cpp-python 0.3.36, ik_llama.cpp
8337e4cd), on a few-MB synthetic model: a replay of two request classes (one with a cached prefix, two in flight),
and the failures a run must survive without a hang or a leftover server: a flag the server refuses, a taken port,
a server killed mid-request, a Ctrl-C of the caller. After every test no llama-server of these builds is left.

Every replay is tiny (tens of prompt tokens, a few generated); each server starts in well under a second."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from planner.errors import InputError
from planner.gguf_header import load_inventory
from planner.plan import Knobs, Plan
from planner.workload import RequestClass, Workload
from planner.engine_contract import BenchRun
from runtime.llamaserver import LlamaServerEngine, TokenSource, as_workload
from runtime.server_process import find_server
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

# 24 new tokens on an empty slot; 8 new after a 40-token prefix that each of 2 slots has cached
TWO_CLASSES = Workload("two", (RequestClass(24, 0, 4), RequestClass(8, 40, 4, weight=3.0, in_flight=2)))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # with a made-up vocabulary: the server turns each generated id into text (none: llama.cpp aborts there)
    return write_gguf(tmp_path_factory.mktemp("server_models") / "qwen3moe.gguf", tiny_spec("qwen3moe"),
                      uniform_recipe("Q8_0"), vocab=True)[0]


@pytest.fixture(scope="module")
def inv(model):
    return load_inventory(model)


@pytest.fixture(params=[pytest.param("mainline", marks=pytest.mark.llamacpp), pytest.param("ik", marks=pytest.mark.ik)])
def server(request) -> Path:
    """The llama-server of one dialect (built once per machine by its fixture in tests/conftest.py)."""
    return request.getfixturevalue("llama_server" if request.param == "mainline" else "ik_server")


def servers_of(binary: Path) -> list[int]:
    """Pids of running processes of this binary (/proc/PID/exe)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/exe") == str(binary.resolve()):
                    out.append(int(pid))
            except OSError:
                continue
    return out


@pytest.fixture
def engine(server, request):
    """make(**kw) -> LlamaServerEngine on this dialect's server; afterwards no process of the binary is left."""
    def make(**kw) -> LlamaServerEngine:
        return LlamaServerEngine(server, **{"timeout_s": 120.0, "start_timeout_s": 60.0, **kw})
    yield make
    left = servers_of(server)
    assert not left, f"llama-server processes left behind: {left}"


def cpu_plan(inv, dialect: str) -> Plan:
    return Plan(inv.name, {t.name: "CPU" for t in inv.allocated()}, Knobs(n_ubatch=64, n_batch=64), dialect)


# ---- replays ---------------------------------------------------------------------------------------------------------

def test_a_two_class_replay_reuses_the_cached_prefix(engine, inv, server):
    e = engine()
    m = e.measure_workload(inv, cpu_plan(inv, e.info.dialect), TWO_CLASSES)
    assert m.ok, m.error + "\n" + m.raw["log_tail"]
    # -c is the workload's: 2 slots x the longest request (40 + 8 + 4 = 52 tokens); -np its 2 in flight
    argv = m.raw["argv"]
    assert argv[argv.index("-c") + 1] == "104" and argv[argv.index("-np") + 1] == "2"
    assert e.info.no_webui and set(e.info.no_webui) <= set(argv)      # mainline --no-webui, ik --webui none
    first, second = m.raw["classes"]
    # the server processed exactly the new tokens: the second class's 40-token prefix came from the slot's cache
    assert (first["prompt_n"], first["cached_n"]) == (24, 0)
    assert (second["prompt_n"], second["cached_n"]) == (8, 40)
    assert [s["prompt_n"] for s in second["samples"]] == [8] * 4      # 2 slots x 2 repetitions, every one
    assert first["requests"] == 2 and second["requests"] == 4
    for row in (first, second):
        assert row["predicted_n"] == 4 and 0 < row["ttft_s"] <= row["request_s"]
        assert row["pp_tps"] > 0 and row["tg_tps"] > 0
    # the Measurement's rates are the classes' means weighted 1:3; the objective is the weighted request time
    assert m.pp_tps == pytest.approx((first["pp_tps"] + 3 * second["pp_tps"]) / 4, rel=1e-3)
    assert m.tg_tps == pytest.approx((first["tg_tps"] + 3 * second["tg_tps"]) / 4, rel=1e-3)
    assert m.raw["mean_request_s"] == pytest.approx((first["request_s"] + 3 * second["request_s"]) / 4, rel=1e-3)
    assert m.raw["tokens_per_s"] > 0 and not any("processed" in n for n in m.raw["notes"])
    # the slowest class's TTFT (what tune --ttft limits)
    assert m.raw["ttft_max_s"] == pytest.approx(max(first["ttft_s"], second["ttft_s"]), abs=1e-6)
    assert m.peak_bytes == {} and m.host_bytes > 1 << 20          # no GPU here; the server's VmHWM


def test_a_growing_context_is_prefilled_once(engine, inv, server, monkeypatch):
    """Classes whose cached context grows (an agent's history): each warm request prefills only what the slot did
    not hold; a shorter context is the longer one's start, all cached. The timed requests are as with fresh
    prefixes: exactly the new tokens processed after the whole context from the cache."""
    import runtime.llamaserver as ls
    seen: list[tuple[int, int, int]] = []              # (prompt length, n_predict, prompt_n the server processed)
    real = ls.completion

    def observed(port, body, timeout_s):
        r = real(port, body, timeout_s)
        seen.append((len(body["prompt"]), body["n_predict"], r.prompt_n))
        return r
    monkeypatch.setattr(ls, "completion", observed)
    grow = Workload("grow", (RequestClass(8, 32, 2), RequestClass(8, 48, 2), RequestClass(8, 16, 2)))
    e = engine(repetitions=1)
    m = e.measure_workload(inv, cpu_plan(inv, e.info.dialect), grow)
    assert m.ok, m.error + "\n" + m.raw["log_tail"]
    warm = [(n, done) for n, n_predict, done in seen if n_predict == 0]
    assert [n for n, _ in warm] == [32, 48, 16]
    assert warm[0][1] == 32 and warm[1][1] <= 16 + 1 and warm[2][1] <= 1      # not 48 and 16 again
    assert [(r["prompt_n"], r["cached_n"]) for r in m.raw["classes"]] == [(8, 32), (8, 48), (8, 16)]


def test_a_bench_workload_is_one_request_class(engine, inv):
    e = engine(repetitions=5)
    m = e.measure(inv, cpu_plan(inv, e.info.dialect), BenchRun(n_prompt=16, n_gen=3, depth=32, repetitions=1))
    assert m.ok, m.error
    (row,) = m.raw["classes"]
    assert (row["new_tokens"], row["cached_tokens"], row["gen_tokens"], row["requests"]) == (16, 32, 3, 1)
    assert (row["prompt_n"], row["cached_n"], row["predicted_n"]) == (16, 32, 3)


def test_a_hand_made_command_line_gets_the_model_the_workload_context_and_our_port(engine, inv):
    m = engine().serve_args(inv, ["--port", "1", "-ub", "32"], BenchRun(8, 2, 0, 1))
    assert m.ok, m.error
    argv = m.raw["argv"]
    # -m from the inventory, -c/-np from the workload (8 + 2 tokens, 1 slot); the given --port is replaced
    assert argv[:2] == ["-m", inv.source] and argv[argv.index("-c") + 1] == "10" and "-np" in argv
    assert "--port" not in argv and any("--port 1 replaced" in n for n in m.raw["notes"])
    assert m.raw["port"] != 1 and m.raw["classes"][0]["prompt_n"] == 8


# ---- failures --------------------------------------------------------------------------------------------------------

def test_a_flag_the_server_refuses_is_a_failed_measurement_with_its_log(engine, inv):
    m = engine().serve_args(inv, ["--no-such-flag"], TWO_CLASSES)
    assert not m.ok and m.raw["failure"] in ("args", "error")
    # the server's own line, though ik follows it with pages of usage text
    assert "--no-such-flag" in m.error and any("--no-such-flag" in ln for ln in m.raw["log_reasons"])


def test_a_taken_port_is_a_failed_measurement(engine, inv):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        e = engine(port=s.getsockname()[1])
        m = e.measure_workload(inv, cpu_plan(inv, e.info.dialect), TWO_CLASSES)
    assert not m.ok and m.raw["failure"] == "port", m.error
    assert "couldn't bind" in m.error


def test_a_server_killed_mid_request_fails_the_measurement_without_a_hang(engine, inv, server):
    killed = threading.Event()

    def kill_soon(event: str) -> None:
        if event.startswith("class 1/1 rep 1"):          # the timed request goes out right after this
            def kill() -> None:
                time.sleep(0.3)
                for pid in servers_of(server):
                    os.kill(pid, signal.SIGKILL)
                killed.set()
            threading.Thread(target=kill, daemon=True).start()
    e = engine(progress=kill_soon)
    # about 2000 tokens to generate: seconds on this model, so the kill lands mid-request
    long = Workload("long", (RequestClass(16, 0, 2000),))
    t0 = time.monotonic()
    m = e.measure_workload(inv, cpu_plan(inv, e.info.dialect), long)
    assert killed.is_set() and time.monotonic() - t0 < 30
    assert not m.ok and m.raw["failure"] == "died", m.error
    assert "SIGKILL" in m.error


def test_ctrl_c_during_the_replay_stops_the_server(engine, inv, server):
    seen: list[int] = []

    def interrupt(event: str) -> None:
        if event.startswith("class 2/2"):
            seen.extend(servers_of(server))
            raise KeyboardInterrupt
    e = engine(progress=interrupt)
    with pytest.raises(KeyboardInterrupt):
        e.measure_workload(inv, cpu_plan(inv, e.info.dialect), TWO_CLASSES)
    assert len(seen) == 1 and not servers_of(server)


def test_kill_9_of_the_caller_takes_its_server_down(engine, model, server, tmp_path):
    """A tuner killed with SIGKILL runs no finally: the server dies with it all the same (PR_SET_PDEATHSIG)."""
    import subprocess
    import sys
    started = tmp_path / "started"
    code = (f"import pathlib, time\n"
            f"from planner.gguf_header import load_inventory\n"
            f"from planner.plan import Knobs, Plan\n"
            f"from planner.workload import RequestClass, Workload\n"
            f"from runtime.llamaserver import LlamaServerEngine\n"
            f"inv = load_inventory({str(model)!r})\n"
            f"e = LlamaServerEngine({str(server)!r}, progress=lambda s: pathlib.Path({str(started)!r}).touch()\n"
            f"                      if s == 'healthy' else None)\n"
            f"plan = Plan(inv.name, {{t.name: 'CPU' for t in inv.allocated()}}, Knobs(n_ubatch=64, n_batch=64), "
            f"e.info.dialect)\n"
            f"e.measure_workload(inv, plan, Workload('long', (RequestClass(16, 0, 100000),)))\n")
    root = Path(__file__).resolve().parents[2]
    tuner = subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline and tuner.poll() is None:
            time.sleep(0.05)
        assert started.exists() and len(servers_of(server)) == 1
        tuner.kill()
        tuner.wait(10)
        deadline = time.monotonic() + 10
        while servers_of(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not servers_of(server)
    finally:
        if tuner.poll() is None:
            tuner.kill()


def test_input_no_run_could_succeed_with_is_an_input_error(engine, inv):
    e = engine()
    other = "ik" if e.info.dialect == "mainline" else "mainline"
    with pytest.raises(InputError, match="re-plan with --dialect"):
        e.measure_workload(inv, cpu_plan(inv, other), TWO_CLASSES)
    with pytest.raises(InputError, match="-np 1: the workload has 2 requests in flight"):
        e.serve_args(inv, ["-np", "1"], TWO_CLASSES)


# ---- pieces without a server -----------------------------------------------------------------------------------

def test_fresh_token_runs_never_start_alike_within_the_vocabulary():
    src = TokenSource(n_vocab=50, seed=1)
    runs = [src.fresh(5) for _ in range(50)]
    assert len({r[0] for r in runs}) == 50 and all(0 <= t < 50 for r in runs for t in r)
    assert src.fresh(0) == [] and len(src.fresh(1)) == 1


def test_a_bench_workload_maps_to_one_class():
    wl, reps = as_workload(BenchRun(n_prompt=512, n_gen=128, depth=4096, repetitions=3))
    assert wl.classes == (RequestClass(512, 4096, 128),) and reps == 3
    wl, _ = as_workload(BenchRun(n_prompt=0, n_gen=64))         # TG only: a one-token cached prompt
    assert wl.classes == (RequestClass(0, 1, 64),)
    assert as_workload(TWO_CLASSES) == (TWO_CLASSES, None)


def test_find_server_says_where_it_looked(tmp_path):
    with pytest.raises(InputError, match=r"\$LLAMA_SERVER"):
        find_server(env={"PATH": str(tmp_path)})
    with pytest.raises(InputError, match="no such file"):
        find_server(tmp_path / "nope")


def test_a_fit_reference_at_a_kv_type_runs_with_that_cache(engine, inv):
    """--fit as a user runs it after seeing the pick use q8_0 KV: -ctk/-ctv q8_0 with flash attention (a quantized
    V cache needs it), at the ubatch asked; on this CPU-only machine without the fit (no device memory to fit)."""
    e = engine()
    m = e.fit_reference(inv, TWO_CLASSES, {}, 1024, kv_type="q8_0")
    assert m.ok, m.error + "\n" + m.raw["log_tail"]
    argv = m.raw["argv"]
    assert argv[argv.index("-ctk") + 1] == argv[argv.index("-ctv") + 1] == "q8_0"
    assert argv[argv.index("-fa") + 1] == "on" and argv[argv.index("-ub") + 1] == "1024"
