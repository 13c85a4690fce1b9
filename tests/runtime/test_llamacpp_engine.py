"""The llamacpp engine against the real CPU llama-bench / llama-fit-params (llama.cpp of llama-cpp-python 0.3.36,
built once per machine), and against small fake binaries (shell scripts) for what a CPU build cannot show:
a hung process, a crash, ik_llama.cpp's llama-bench and llama-sweep-bench, nvidia-smi.

Every real run is tiny (-p 8 -n 2 -r 1 on a few-MB synthetic model)."""
from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from offload_tuner.cli import main
from planner.errors import InputError
from planner.flags import parse, render
from planner.gguf_header import load_inventory
from planner.plan import Knobs, OffloadPolicy, Plan
from runtime import gpumem
from planner.engine_contract import Engine, BenchRun
from runtime.llamacpp import LlamaCppEngine, bench_contexts, bench_memory, loader_placement, oracle, our_overrides
from runtime.llamacpp_binary import find_binary, probe
from runtime.process import run_process
from runtime.llamacpp_output import classify_failure, parse_bench_output, parse_sweep_output
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

TINY = BenchRun(n_prompt=8, n_gen=2, depth=0, repetitions=1)


# ---- models and binaries -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny synthetic models: qwen3moe (2 MoE layers), gpt-oss (expert biases), deepseek2 (a dense first layer)."""
    d = tmp_path_factory.mktemp("models")
    return {arch: write_gguf(d / f"{arch}.gguf", tiny_spec(arch), uniform_recipe("Q8_0"))[0]
            for arch in ("qwen3moe", "gpt-oss", "deepseek2")}


@pytest.fixture(scope="module")
def inv(models):
    return load_inventory(models["qwen3moe"])


@pytest.fixture(scope="module")
def fit_params(llama_bench) -> Path:
    from runtime.llamacpp_build import ensure_built
    return ensure_built()["llama-fit-params"]


def everything_on(inv, device: str = "CPU", **moved: str) -> dict[str, str]:
    """Every tensor on `device` (token_embd on the CPU, as llama.cpp keeps it), then the `moved` exceptions."""
    a = {t.name: ("CPU" if t.role == "token_embd" else device) for t in inv.allocated()}
    a.update(moved)
    return a


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


MAINLINE_HELP = """usage: llama-bench [options]
  -o, --output <csv|json|jsonl|md|sql>
  -fitt, --fit-target <MiB>
  -p, --n-prompt <n>
  -n, --n-gen <n>
  -r, --repetitions <n>
"""


# ---- the binary: what it is and accepts ------------------------------------------------------------------------------

@pytest.mark.llamacpp
def test_probe_reads_dialect_abilities_and_ngl_rule(llama_bench):
    info = probe(llama_bench)
    assert (info.tool, info.dialect, info.output_format) == ("bench", "mainline", "jsonl")
    assert info.abilities == {"override_tensor": True, "n_cpu_moe": True, "no_op_offload": True, "depth": True,
                              "fit_target": True, "gen_at_depth": False, "load_mode": True}
    # llama-cpp-python's vendored build reports build 0; -fitt (PR #21304) postdates output-first -ngl (#18148)
    assert info.build_number is None and info.ngl_rule == "last_slots" and "-fitt" in info.ngl_rule_source
    assert probe(llama_bench) is info          # cached per path and mtime


def test_find_binary_order(tmp_path, monkeypatch):
    fake = script(tmp_path / "llama-bench", "exit 0\n")
    assert find_binary(fake) == fake
    assert find_binary(None, {"LLAMA_BENCH": str(fake)}) == fake
    assert find_binary(None, {"PATH": str(tmp_path)}) == fake
    with pytest.raises(InputError, match="no llama-bench found"):
        find_binary(None, {"PATH": str(tmp_path / "empty")})
    with pytest.raises(InputError, match="no such file"):
        find_binary(tmp_path / "nope")


def test_not_a_benchmark_binary(tmp_path):
    with pytest.raises(InputError, match="does not look like llama-bench"):
        LlamaCppEngine(script(tmp_path / "tool", "echo 'usage: tool [--frobnicate]'\n"))


# ---- every flag the renderer emits, through the real binary ----------------------------------------------------------

def _rendered_cases(inv_q, inv_oss):
    few_experts = everything_on(inv_q, "CUDA0", **{"blk.1.ffn_up_exps.weight": "CPU",
                                                  "blk.1.ffn_gate_exps.weight": "CPU",
                                                  "blk.0.ffn_down_exps.weight": "CPU"})
    oss = everything_on(inv_oss, "CUDA0",
                        **{t.name: "CPU" for t in inv_oss.allocated() if t.layer == 0 and t.is_expert})
    return [
        # (id, inventory, plan, workload, flags that must appear)
        ("knobs", inv_q, Plan("m", everything_on(inv_q), Knobs(n_batch=512, n_ubatch=256, n_threads=1, type_k="q8_0",
                                                               type_v="q8_0", flash_attn=True, mmap=False,
                                                               offload=OffloadPolicy.all(False)), "mainline"),
         BenchRun(8, 2, 4, 1), ["-b", "-ub", "-t", "-ctk", "-ctv", "-fa", "-lm", "-nopo", "-d"]),
        ("no-fa", inv_q, Plan("m", everything_on(inv_q), Knobs(flash_attn=False, n_threads=1), "mainline"), TINY,
         ["-fa"]),
        ("ncmoe", inv_q, Plan("m", everything_on(inv_q, "CUDA0", **{t.name: "CPU" for t in inv_q.allocated()
                                                                    if t.is_expert}), Knobs(n_threads=1), "mainline"),
         TINY, ["-ngl", "-ncmoe"]),
        ("ot-set", inv_q, Plan("m", few_experts, Knobs(n_threads=1, offload=OffloadPolicy.all(True, 64)), "mainline"),
         TINY, ["-ngl", "-ot"]),
        ("bias", inv_oss, Plan("m", oss, Knobs(n_threads=1), "mainline"), TINY, ["-ngl"]),
    ]


@pytest.mark.llamacpp
def test_every_rendered_flag_is_accepted_and_read_as_meant(llama_bench, models, inv):
    inv_oss = load_inventory(models["gpt-oss"])
    engine = LlamaCppEngine(llama_bench, timeout_s=60)
    for case, inv_c, plan, wl, flags in _rendered_cases(inv, inv_oss):
        path = models["gpt-oss" if inv_c is inv_oss else "qwen3moe"]
        # render directly: on a CPU build the engine refuses a plan that names CUDA0 (test below); the flags such a
        # plan renders (-ngl, -ncmoe, -ot ...=CPU) are still what the real binary must accept
        rc = render(plan, inv_c, "bench", bench=wl, model_path=str(path))
        for f in flags:
            assert f in rc, (case, list(rc))
        m = engine.measure_args(list(rc), wl, env=rc.env)
        assert m.ok, (case, m.error, m.raw.get("log_tail"))
        assert m.pp_tps > 0 and m.tg_tps > 0 and m.host_bytes > 0
        assert m.peak_bytes == {}                            # no GPU, no verbose log: nothing to say
        pp, tg = m.raw["tests"]
        assert (pp["kind"], pp["n_prompt"], pp["n_depth"]) == ("pp", wl.n_prompt, wl.depth)
        assert (tg["kind"], tg["n_gen"]) == ("tg", wl.n_gen)
        s = pp["settings"]
        k = plan.knobs
        assert (s["n_batch"], s["n_ubatch"], s["type_k"], s["type_v"]) == (k.n_batch, k.n_ubatch, k.type_k, k.type_v)
        assert s["flash_attn"] == int(k.flash_attn) and s["no_op_offload"] == int(not k.offload.any_enabled)
        assert s["load_mode"] in (("auto", "mmap") if k.mmap else ("none",))
        if k.n_threads:
            assert s["n_threads"] == k.n_threads
        ot = rc[rc.index("-ot") + 1] if "-ot" in rc else None
        assert s["tensor_buft_overrides"] == (ot or "none")   # the binary echoes the set it parsed
        if "-ncmoe" in rc:
            assert s["n_cpu_moe"] == int(rc[rc.index("-ncmoe") + 1])
        if rc.env:
            assert rc.env == {"GGML_OP_OFFLOAD_MIN_BATCH": "64"}


@pytest.mark.llamacpp
def test_semicolon_joins_a_set_and_comma_makes_alternative_configs(llama_bench, models, inv):
    args = ["-m", str(models["qwen3moe"]), "-p", "8", "-n", "0", "-r", "1", "-t", "1",
            "-ot", r"blk\.0\.attn_q=CPU;exps=CPU,ffn_down=CPU"]
    engine = LlamaCppEngine(llama_bench, timeout_s=60)
    m = engine.measure_args(args, BenchRun(8, 0, 0, 1))
    assert m.ok, m.error
    sets = [t["settings"]["tensor_buft_overrides"] for t in m.raw["tests"]]
    assert sets == [r"blk\.0\.attn_q=CPU;exps=CPU", "ffn_down=CPU"]     # two configurations, one test each
    pc = parse(args, inv, "mainline", tool="bench")                   # ours explains the first and says so
    assert [o.pattern for o in pc.overrides] == [r"blk\.0\.attn_q", "exps"]
    assert any(w.startswith("W003") for w in pc.warnings)


@pytest.mark.llamacpp
def test_engine_measure_end_to_end_and_json_output_too(llama_bench, inv):
    engine = LlamaCppEngine(llama_bench, timeout_s=60)
    assert isinstance(engine, Engine)
    plan = Plan("m", everything_on(inv), Knobs(n_threads=1), "mainline")
    cmd = engine.command(inv, plan, TINY)
    assert cmd.argv[:2] == ("-o", "jsonl") and str(inv.source) in cmd.argv
    m = engine.measure(inv, plan, TINY)
    assert m.ok and m.pp_tps > 0 and m.tg_tps > 0 and m.raw["command"] == cmd.shell
    j = engine.measure_args(["-o", "json", *cmd.argv[2:]], TINY)   # a json array parses the same
    assert j.ok and [t["kind"] for t in j.raw["tests"]] == ["pp", "tg"]


# ---- failures --------------------------------------------------------------------------------------------------------

@pytest.mark.llamacpp
def test_errors_of_the_real_binary_are_recognised(llama_bench, models, tmp_path):
    good = models["qwen3moe"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) // 3])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    engine = LlamaCppEngine(llama_bench, timeout_s=60)
    base = ["-p", "8", "-n", "0", "-r", "1", "-t", "1"]
    cases = [
        (["-m", str(models["qwen3moe"]), "-ot", "exps=CUDA0"], "buft", ["'CUDA0'", "this build has: CPU"]),
        (["-m", str(tmp_path / "missing.gguf")], "load", ["No such file"]),
        (["-m", str(truncated)], "load", ["not within the file bounds"]),
        (["-m", str(garbage)], "load", ["invalid magic"]),
        (["-m", str(models["qwen3moe"]), "-fa", "0", "-ctv", "q8_0"], "context", ["flash_attn"]),
        (["-m", str(models["qwen3moe"]), "--no-such-flag"], "args", ["--no-such-flag"]),
    ]
    for args, kind, needles in cases:
        m = engine.measure_args(args + base, BenchRun(8, 0, 0, 1))
        assert not m.ok and m.raw["failure"] == kind, (args, m.error)
        for n in needles:
            assert n in m.error, (args, m.error)
        assert m.raw["log_tail"] or m.raw["stdout_tail"]
        # load and context failures say why only with -v: the engine re-ran once to find out
        assert m.raw["verbose_rerun"] == (kind in ("load", "context"))
        assert m.raw["argv"][:2] == ["-o", "jsonl"]      # -o first: a later -o would hide a bad -ot


@pytest.mark.llamacpp
def test_gpu_plan_on_a_cpu_build_is_an_input_error(llama_bench, inv):
    engine = LlamaCppEngine(llama_bench, timeout_s=60)
    assert engine.devices() == {}
    plan = Plan("m", everything_on(inv, "CUDA0"), Knobs(), "mainline")
    with pytest.raises(InputError, match="sees no such device"):
        engine.measure(inv, plan, TINY)
    with pytest.raises(InputError, match="plan is for ik"):
        engine.measure(inv, replace(plan, dialect="ik"), TINY)
    with pytest.raises(InputError, match="needs the model file"):
        LlamaCppEngine(llama_bench, model_path="/nonexistent.gguf").measure(
            inv, replace(plan, assignment=everything_on(inv)), TINY)


def test_old_ngl_rule_and_missing_flags_are_refused(tmp_path, inv):
    old = script(tmp_path / "llama-bench", """case "$1" in
--help) cat <<'EOF'
usage: llama-bench [options]
  -h, --help   --version   -o, --output <csv|json|jsonl|md|sql>   -v, --verbose
  -m, --model <filename>   -p, --n-prompt <n>   -n, --n-gen <n>   -r, --repetitions <n>   -d, --n-depth <n>
  -b, --batch-size <n>   -ub, --ubatch-size <n>   -ngl, --n-gpu-layers <n>   -fa, --flash-attn <on|off|auto>
  -ot --override-tensor <tensor name pattern>=<buffer type>;...
EOF
exit 0;;
--version) echo "version: 7000 (0123abc)"; exit 0;;
esac
""")
    engine = LlamaCppEngine(old, model_path=inv.source)
    assert (engine.info.build_number, engine.info.ngl_rule) == (7000, "last_blocks")   # before PR #18148
    assert engine.devices() is None                      # no --list-devices: nothing to check up front
    # output + the last block on the GPU: mainline's -ngl 2 today; this build's -ngl 2 = blocks 0 and 1
    plan = Plan("m", everything_on(inv, "CPU", **{t.name: "CUDA0" for t in inv.allocated()
                                                 if t.layer == 1 or t.role in ("output", "output_norm")}),
                Knobs(), "mainline")
    # the command is rendered for the build (planner/builds.py: PR 18148 is build 7467), so it says the plan in
    # this build's own -ngl terms; told the binary counts otherwise, the engine refuses rather than run it wrong
    argv = list(engine.command(inv, plan, TINY).argv)
    assert parse(argv[2:], inv, "mainline", tool="bench", build=engine.info.build).assignment == plan.assignment
    with pytest.raises(InputError, match="counts -ngl as last_slots"):
        LlamaCppEngine(old, model_path=inv.source, ngl_rule="last_slots").command(inv, plan, TINY)
    everything = Plan("m", everything_on(inv, "CUDA0"), Knobs(), "mainline")
    assert "-ngl" in engine.command(inv, everything, TINY).argv          # all layers: the same under both rules
    with pytest.raises(InputError, match="does not accept -nopo"):
        engine.command(inv, replace(everything, knobs=Knobs(offload=OffloadPolicy.all(False))), TINY)
    assert LlamaCppEngine(old, ngl_rule="last_slots").info.ngl_rule_source == "given"


TWO_GPU_HELP = """usage: llama-bench [options]
  -h, --help   --version   --list-devices   -o, --output <csv|json|jsonl|md|sql>   -v, --verbose
  -m, --model <filename>   -p, --n-prompt <n>   -n, --n-gen <n>   -r, --repetitions <n>   -d, --n-depth <n>
  -b, --batch-size <n>   -ub, --ubatch-size <n>   -ngl, --n-gpu-layers <n>   -fa, --flash-attn <on|off|auto>
  -fitt, --fit-target <MiB>   -dev, --device <dev0/dev1/...>   -ts, --tensor-split <ts0/ts1/..>
  -ot --override-tensor <tensor name pattern>=<buffer type>;...
"""


def test_a_plan_on_fewer_gpus_than_the_machine_has_is_run_on_those_alone(tmp_path, inv):
    """llama.cpp splits -ngl's layers over every GPU it sees (by free memory): on a two-GPU machine a CUDA0 plan
    runs with -dev CUDA0, a plan on both GPUs as it is (its -ts), a CPU plan without -dev."""
    (tmp_path / "help.txt").write_text(TWO_GPU_HELP)
    (tmp_path / "devices.txt").write_text("Available devices:\n  CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free)\n"
                                          "  CUDA1: NVIDIA H200 (143771 MiB, 143000 MiB free)\n")
    two = script(tmp_path / "llama-bench", f"""case "$1" in
--help) cat {tmp_path / 'help.txt'}; exit 0;;
--version) echo "version: 8000 (0123abc)"; exit 0;;
--list-devices) cat {tmp_path / 'devices.txt'}; exit 0;;
esac
""")
    engine = LlamaCppEngine(two, model_path=inv.source)
    assert set(engine.devices()) == {"CUDA0", "CUDA1"}
    one = Plan("m", everything_on(inv, "CUDA0"), Knobs(), "mainline")
    argv = list(engine.command(inv, one, TINY).argv)
    assert argv[argv.index("-dev") + 1] == "CUDA0"
    both = Plan("m", {n: ("CUDA1" if d != "CPU" and not n.startswith("blk.0.") else d)
                      for n, d in one.assignment.items()}, Knobs(), "mainline")
    argv = list(engine.command(inv, both, TINY).argv)
    assert "-dev" not in argv and "-ts" in argv
    assert "-dev" not in engine.command(inv, Plan("m", everything_on(inv), Knobs(), "mainline"), TINY).argv


def test_hung_process_is_ended_with_its_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    fake = script(tmp_path / "llama-bench", f"""case "$1" in --help) cat <<'EOF'
{MAINLINE_HELP}EOF
exit 0;; esac
sleep 600 &
echo $! > {pidfile}
wait
""")
    engine = LlamaCppEngine(fake, timeout_s=1.0)
    t0 = time.monotonic()
    m = engine.measure_args(["-p", "8"], TINY)
    assert time.monotonic() - t0 < 10
    assert not m.ok and m.raw["failure"] == "timeout" and "timed out after 1 s" in m.error
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child), "the grandchild (sleep) survived"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_crash_is_a_failed_measurement(tmp_path):
    fake = script(tmp_path / "llama-bench", f"""case "$1" in --help) cat <<'EOF'
{MAINLINE_HELP}EOF
exit 0;; esac
echo 'GGML_ASSERT(ne0 > 0) failed' >&2
kill -SEGV $$
""")
    m = LlamaCppEngine(fake, timeout_s=30).measure_args(["-p", "8"], TINY)
    assert not m.ok and m.raw["failure"] == "crash" and m.raw["returncode"] == -11
    assert "SIGSEGV" in m.error and "GGML_ASSERT" in m.error


def test_out_of_memory_texts():
    cases = {
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 20480.00 MiB on device 0: cudaMalloc failed: out of "
        "memory\nalloc_tensor_range: failed to allocate CUDA0 buffer of size 21474836480\n": "cudaMalloc of 20480.00 "
        "MiB on CUDA0",
        "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 1073741824\n": "CUDA0 buffer of 1024.0 MiB",
        "llama_model_load: error loading model: unable to allocate CUDA0 buffer\nfailed to load model\n":
            "unable to allocate CUDA0 buffer",
        "CUDA error: out of memory\n  current device: 0, in function ggml_cuda_pool_vmm::alloc\n": "CUDA error",
        "llama_kv_cache: failed to allocate buffer for kv cache\n": "kv cache",
    }
    for text, needle in cases.items():
        f = classify_failure("", text, -6)
        assert f is not None and f.kind == "oom" and needle in f.message, (text, f)
    assert classify_failure("", "", 0) is None
    assert classify_failure("", "", 0, have_results=False).kind == "no_output"
    assert classify_failure("", "killed", -9).message.startswith("crashed with SIGKILL")


# ---- parsing the output of both dialects -----------------------------------------------------------------------------

def test_bench_output_parses_partial_runs_and_nonfinite_rates():
    text = ('{"n_prompt": 8, "n_gen": 0, "n_depth": 0, "avg_ts": inf, "stddev_ts": nan, "samples_ts": [ inf ]}\n'
            '{"n_prompt": 0, "n_gen": 2, "n_depth": 0, "avg_ts": 12.5, "stddev_ts": 0.5, '
            '"samples_ts": [ 12, 13, 20 ]}\n'
            '{"n_prompt": 0, "n_gen": 2, "avg_')
    pp, tg = parse_bench_output(text)
    assert pp.kind == "pp" and pp.avg_ts == float("inf")
    assert tg.kind == "tg" and tg.median_ts == 13 and tg.avg_ts == 12.5


def _ik_bench(tmp_path: Path) -> Path:
    argfile = tmp_path / "args"
    rec = {"build_commit": "abc", "cuda": False, "n_batch": 2048, "n_ubatch": 512, "mla_attn": 3, "avg_ns": 1,
           "stddev_ns": 0}
    pp = {**rec, "n_prompt": 16, "n_gen": 0, "avg_ts": 100.0, "stddev_ts": 1.0, "test": "pp16",
          "samples_ts": [99.0, 101.0, 150.0]}
    tg = {**rec, "n_prompt": 64, "n_gen": 4, "avg_ts": 10.0, "stddev_ts": 0.0, "test": "tg4@pp64", "samples_ts": [10.0]}
    help_text = """usage: llama-bench [options]
  -m, --model <filename>   -p, --n-prompt <n>   -n, --n-gen <n>   -pg <pp,tg>   -gp <pp,tg>
  -b, --batch-size <n>   -ub, --ubatch-size <n>   -t, --threads <n>   -ngl, --n-gpu-layers <n>   --n-cpu-moe <n>
  -fa, --flash-attn <0|1>   -mla, --mla-attn <0|1|2>   -amb, --attn-max-batch <i>   -fmoe, --fused-moe <0|1>
  -r, --repetitions <n>   -o, --output <csv|json|md|sql>   -v, --verbose   -ot, --override-tensor pattern
"""
    out = "[\n  " + json.dumps(pp) + ",\n  " + json.dumps(tg) + "\n]\n"
    return script(tmp_path / "llama-bench", f"""case "$1" in --help) cat <<'EOF'
{help_text}EOF
exit 0;; esac
echo "$@" > {argfile}
cat <<'EOF'
{out}EOF
""")


def test_ik_llama_bench_json_and_depth_through_gp(tmp_path, inv):
    engine = LlamaCppEngine(_ik_bench(tmp_path), timeout_s=30, model_path=inv.source)
    assert engine.info.dialect == "ik" and engine.info.ngl_rule == "last_blocks"
    assert engine.info.output_format == "json" and engine.info.abilities["gen_at_depth"]
    plan = Plan("m", everything_on(inv), Knobs(), "ik")
    m = engine.measure(inv, plan, BenchRun(16, 4, 64, 1))
    assert m.ok, m.error
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-gp") + 1] == "64,4" and args[args.index("-o") + 1] == "json"
    assert ("-mla" in args) == inv.hparams.is_mla          # ik's MLA flags only for a model with MLA
    assert args[args.index("-n") + 1] == "0"          # tg only through -gp
    assert m.pp_tps == 101.0 and m.tg_tps == 10.0     # medians of the samples
    assert [(t["kind"], t["n_depth"]) for t in m.raw["tests"]] == [("pp", 0), ("tg", 64)]
    assert any("-gp" in n for n in m.raw["notes"])
    with pytest.raises(InputError, match="plan is for mainline"):
        engine.measure(inv, replace(plan, dialect="mainline"), TINY)


def test_ik_sweep_bench_table_and_jsonl(tmp_path, inv):
    rows = [{"n_kv_max": 1536, "n_batch": 2048, "n_ubatch": 512, "pp": 512, "tg": 128, "n_kv": n, "t_pp": 1.0,
             "speed_pp": 500.0 - n / 10, "t_tg": 2.0, "speed_tg": 64.0 - n / 100} for n in (0, 512, 1024)]
    help_text = """usage: llama-sweep-bench
  -m, --model FNAME   -c, --ctx-size N   -np, --parallel N   -b, --batch-size N   -ub, --ubatch-size N
  -ngl, --n-gpu-layers N   -fa, --flash-attn   -mla, --mla-use   -amb, --attention-max-batch   -n, --n-predict N
  -ot, --override-tensor   -v, --verbose
sweep-bench specific options:
  -nrep, --n-repetitions N
         --output-format FORMAT    output format: table (default) or jsonl
"""
    fake = script(tmp_path / "llama-sweep-bench", f"""case "$1" in --help) cat <<'EOF'
{help_text}EOF
exit 0;; esac
echo "$@" > {tmp_path / 'args'}
cat <<'EOF'
{chr(10).join(json.dumps(r) for r in rows)}
EOF
""")
    engine = LlamaCppEngine(fake, timeout_s=30, model_path=inv.source)
    assert (engine.info.tool, engine.info.dialect) == ("sweep", "ik")
    m = engine.measure(inv, Plan("m", everything_on(inv), Knobs(), "ik"), BenchRun(512, 128, 600, 2))
    assert m.ok and (m.pp_tps, m.tg_tps) == (500.0 - 51.2, 64.0 - 5.12)     # the row at n_kv = 512
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-c") + 1] == str(512 + 512) and args[args.index("-nrep") + 1] == "2"
    assert args[args.index("--output-format") + 1] == "jsonl"
    table = ("|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |\n"
             "|-------|--------|--------|----------|----------|----------|----------|\n"
             "|   512 |    128 |      0 |    0.512 |  1000.00 |    4.000 |    32.00 |\n"
             "|   512 |    128 |    512 |    0.600 |   853.33 |    4.200 |    30.48 |\n")
    assert [(r.n_kv, r.pp_tps, r.tg_tps) for r in parse_sweep_output(table)] == \
        [(0, 1000.0, 32.0), (512, 853.33, 30.48)]


# ---- VRAM sampling through nvidia-smi (a fake one) -------------------------------------------------------------------

@pytest.mark.slow
def test_nvidia_smi_sampler_peak_minus_baseline(tmp_path):
    fake_smi = script(tmp_path / "nvidia-smi", """case "$*" in
*loop-ms*) for v in 1000 5000 3000; do echo "0, $v"; echo "1, 7"; sleep 0.05; done; sleep 600;;
*memory.free*) echo "0, 80000"; echo "1, 80000";;
*) echo "0, 1000"; echo "1, 7";;
esac
""")
    sampler = gpumem.NvidiaSmiSampler(0.05, str(fake_smi))
    assert sampler.free() == {0: 80000 << 20, 1: 80000 << 20}
    child = script(tmp_path / "child", "sleep 0.5\n")
    run = run_process([str(child)], {**os.environ, "CUDA_VISIBLE_DEVICES": "1,0"}, 30, sampler)
    assert run.vram_source == "nvidia-smi" and run.gpu_samples >= 4
    # CUDA_VISIBLE_DEVICES=1,0: CUDA0 is smi GPU 1, CUDA1 is smi GPU 0 (4000 MiB above its 1000 MiB baseline)
    assert run.gpu_peak_bytes == {"CUDA0": 0, "CUDA1": 4000 << 20}
    assert run.gpu_baseline_bytes == {"CUDA0": 7 << 20, "CUDA1": 1000 << 20}


def test_the_gpus_named_for_a_report(tmp_path, monkeypatch):
    script(tmp_path / "nvidia-smi", 'echo "NVIDIA H200"; echo "NVIDIA H200"\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpumem.gpu_summary() == "2x NVIDIA H200"
    script(tmp_path / "nvidia-smi", "echo 'No devices were found'; exit 6\n")
    assert gpumem.gpu_summary() is None
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpumem.gpu_summary() is None


def test_no_gpu_tools_here_means_no_sampler(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    assert gpumem.detect() is None


# ---- the planner's matcher against the loader's own log lines --------------------------------------------------------

MATCHER_CASES = [
    ("qwen3moe", ["-ot", r"^output=CPU"]),                                    # anchor: output AND output_norm
    ("qwen3moe", ["-ot", r"norm\.weight$=CPU"]),                              # end anchor
    ("qwen3moe", ["-ot", r"blk\.(0|1)\.ffn_(up|gate)_exps=CPU"]),             # alternations
    ("qwen3moe", ["-ot", r"blk\.0\..*=CPU;exps=CPU;blk\.1\.attn_[qk]\.=CPU"]),  # overlapping, first match wins
    ("qwen3moe", ["-ot", r"attn_q=CPU", "-ncmoe", "1"]),                       # -ncmoe joins after the -ot set
    ("qwen3moe", ["-ot", r"[[:digit:]]\.ffn_down=CPU;^token_embd=CPU"]),      # POSIX class, the input layer
    ("gpt-oss", ["-ot", r"ffn_.*_exps\.bias=CPU"]),                           # patterns matching .bias only
    ("gpt-oss", ["-ot", r"blk\.1\.ffn_(up|down)_exps=CPU"]),                  # .weight and .bias alike
    ("deepseek2", ["-ncmoe", "2"]),                                           # layer 0 is dense: nothing to move
    ("deepseek2", ["-ot", r"\.(0|2)\.ffn_(gate|down)=CPU;shexp=CPU"]),        # dense FFN vs shared experts
]


@pytest.mark.llamacpp
def test_matcher_agrees_with_the_loader(llama_bench, models):
    for arch, args in MATCHER_CASES:
        inv_a = load_inventory(models[arch])
        theirs = loader_placement(llama_bench, models[arch], ["-t", "1", *args], timeout_s=60).overridden
        ours = our_overrides(inv_a, ["-t", "1", *args])
        assert ours, (arch, args)
        assert ours == theirs, (arch, args, sorted(set(ours) ^ set(theirs)))


@pytest.mark.llamacpp
def test_no_host_is_accepted_and_the_weights_it_repacks_are_ours(llama_bench, tmp_path):
    """--no-host 1 (mainline's knob no_host) runs on the real llama-bench, which echoes it in its settings. A CPU
    build has no GPU host buffer, so CPU_REPACK is its default anyway: its -v log names the weights of a Q4_0 model
    the CPU backend repacked, and planner.residency.repacked must name the same ones for a --no-host plan (what the
    cost model keeps off op offload on a GPU build)."""
    from planner.residency import repacked
    from runtime.llamacpp_logs import parse_model_buffers, parse_repacked_tensors
    path = write_gguf(tmp_path / "q4_0.gguf", tiny_spec("qwen3moe"), uniform_recipe("Q4_0"))[0]
    inv_q = load_inventory(path)
    plan = Plan("m", everything_on(inv_q), Knobs(n_threads=1, no_host=True), "mainline")
    rc = render(plan, inv_q, "bench", bench=TINY, model_path=str(path))
    assert list(rc)[-2:] == ["--no-host", "1"]
    m = LlamaCppEngine(llama_bench, timeout_s=60).measure_args(list(rc), TINY, env=rc.env)
    assert m.ok, (m.error, m.raw.get("log_tail"))
    assert all(t["settings"]["no_host"] in (1, True) for t in m.raw["tests"])       # echoed as read
    run = run_process([str(llama_bench), "-m", str(path), "-p", "1", "-n", "0", "-r", "1", "--no-warmup", "-o",
                       "jsonl", "-t", "1", "-v", "--no-host", "1"], None, 60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert parse_model_buffers(run.stderr).get("CPU_REPACK", 0) > 0
    theirs = set(parse_repacked_tensors(run.stderr))
    ours = {t.name for t in inv_q.allocated() if repacked(plan, t)}
    assert theirs and ours == theirs, sorted(ours ^ theirs)


# ---- memory: llama-bench's contexts, and llama-fit-params as an oracle -----------------------------------------------

def test_bench_memory_takes_the_larger_context(inv):
    assert bench_contexts(BenchRun(2048, 64, 100, 1)) == [2148, 164]
    assert bench_contexts(BenchRun(0, 64, 0, 1)) == [64]
    plan = Plan("m", everything_on(inv, "CUDA0"), Knobs(n_ubatch=512), "mainline")
    from planner.memory import estimate
    big = estimate(inv, replace(plan, knobs=replace(plan.knobs, n_ctx=2048)))
    got = bench_memory(inv, plan, BenchRun(2048, 64, 0, 1))
    assert got.devices["CUDA0"] == big.devices["CUDA0"]


@pytest.mark.llamacpp
def test_fit_params_oracle(fit_params, models, inv, capsys):
    plan = Plan("m", everything_on(inv), Knobs(n_ctx=1024), "mainline")
    got = oracle(inv, plan, models["qwen3moe"], fit_params)
    assert set(got) == {"CPU"}                                       # a CPU build reports the host only
    weights = sum(t.nbytes for t in inv.allocated())
    assert weights - (1 << 20) < got["CPU"]["model"] <= weights + (1 << 20)   # floored MiB, mmap range slack
    with pytest.raises(InputError, match="could not estimate"):
        oracle(inv, plan, models["qwen3moe"].with_name("missing.gguf"), fit_params)
    code = main(["explain", str(models["qwen3moe"]), "--oracle", str(fit_params), "--json", "--", "-c", "1024",
                 "-np", "1", "-fa", "on"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["oracle"]["devices"]["CPU"]["oracle"]["model"] == got["CPU"]["model"]


# ---- offload-tuner run -----------------------------------------------------------------------------------------------

@pytest.mark.llamacpp
def test_cli_run_llamacpp_json(llama_bench, models, capsys):
    code = main(["run", str(models["qwen3moe"]), "--engine", "llamacpp", "--llama-bench", str(llama_bench),
                 "--n-prompt", "8", "--n-gen", "2", "--reps", "1", "--json",
                 "--", "-ngl", "0", "-t", "1", "-ub", "256"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["measurement"]["ok"] and out["measurement"]["pp_tps"] > 0
    assert set(out["measurement"]) >= {"pp_tps", "tg_tps", "peak_bytes", "ok", "error"}
    assert "CPU" in out["devices"] and out["plan"]["knobs"]["n_ubatch"] == 256 and "-ub 256" in out["command"]


def test_cli_run_shows_the_spread_of_its_repetitions(llama_bench, models, capsys):
    """Issue 40 item 11: `run` says how far its repetitions were apart (llama-bench's samples), PP and TG each; the
    sim engine, which has no repetitions of its own, says nothing of it."""
    import re
    code = main(["run", str(models["qwen3moe"]), "--engine", "llamacpp", "--llama-bench", str(llama_bench),
                 "--n-prompt", "8", "--n-gen", "2", "--reps", "3", "--", "-ngl", "0", "-t", "1"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("PP "))
    m = re.match(r"PP ([\d.]+) t/s \(([\d.]+)-([\d.]+) over 3 reps\), "
                 r"TG ([\d.]+) t/s \(([\d.]+)-([\d.]+) over 3 reps\)", line)
    assert code == 0 and m, line
    pp, lo, hi, tg, tlo, thi = map(float, m.groups())
    assert lo <= pp <= hi and tlo <= tg <= thi          # the median of the samples lies within their range
    assert main(["run", str(models["qwen3moe"]), "--engine", "sim", "--gpu", "2GiB", "--", "-ngl", "0"]) == 0
    assert "reps)" not in capsys.readouterr().out


def test_cli_run_sim_with_a_plan_file(models, tmp_path, capsys):
    assert main(["plan", str(models["qwen3moe"]), "--gpu", "2GiB", "--json"]) == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(capsys.readouterr().out)
    code = main(["run", str(models["qwen3moe"]), "--engine", "sim", "--plan", str(plan_file), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["measurement"]["ok"] and out["devices"]["CUDA0"]["total"] > 0
    assert out["measurement"]["peak_bytes"]["CUDA0"] == out["devices"]["CUDA0"]["total"]


def test_cli_run_bad_input_is_one_line(models, tmp_path, capsys):
    m = str(models["qwen3moe"])
    bad_plan = tmp_path / "bad.json"
    bad_plan.write_text(json.dumps({"model_id": "x", "assignment": {"nope.weight": "CPU"}}))
    import importlib.util
    torch_cases = [] if importlib.util.find_spec("runtime.torch_engine") else [
        (["run", m, "--engine", "torch", "--", "-ngl", "99"], "not available yet")]
    for args, needle in [
        *torch_cases,
        (["run", m, "--engine", "sim"], "neither"),
        (["run", m, "--engine", "sim", "--plan", str(bad_plan)], "does not fit this model"),
        (["run", m, "--engine", "sim", "--reps", "0", "--", "-ngl", "1"], "--reps must be >= 1"),
        (["run", m, "--engine", "llamacpp", "--llama-bench", str(tmp_path / "nope"), "--", "-ngl", "1"],
         "no such file"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (args, err)


# ---- the GPU benchmark's pipeline, dry-run on the CPU build ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.llamacpp
def test_gpu_benchmark_dry_run(llama_bench, tmp_path, bench_script):
    bench = bench_script("llamacpp_gpu")
    out = tmp_path / "out"
    code = bench.main(["--cpu", "--workdir", str(tmp_path / "work"), "--out", str(out), "--budgets", "4",
                       "--plans", "all-gpu,attn-only-nopo,exps-first3-ub2048,planner-4G", "--n-prompt", "16"])
    assert code == 0
    rep = json.loads((out / "llamacpp_gpu.json").read_text())
    assert [p["name"] for p in rep["plans"]] == ["all-gpu", "attn-only-nopo", "exps-first3-ub2048", "planner-4G"]
    assert all(p["measurement"]["ok"] for p in rep["plans"]) and rep["fit"][0]["measurement"]["ok"]
    assert all(r["ok"] for r in rep["matcher"]) and len(rep["matcher"]) == len(bench.MATCHER_CASES)
    # the GPU command line of each plan is recorded (here it ran all-CPU)
    nopo = rep["plans"][1]
    assert "-nopo 1" in nopo["command"] and "-ncmoe" in nopo["command"] and "CUDA0" not in nopo["ran"]
    assert "| attn-only-nopo |" in (out / "llamacpp_gpu.md").read_text()
    # runs for benchmarks/cost_model.py: none from a CPU dry run (what ran is not the GPU command) ...
    assert (out / "llamacpp_gpu_runs.jsonl").read_text() == ""
    # ... and each GPU plan's llama-bench arguments without -m MODEL, op offload off kept
    gpu_plans = [{**p, "cpu_mode": False} for p in rep["plans"]]
    assert bench.write_runs(gpu_plans, tmp_path / "runs.jsonl") == 4
    runs = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["plan"] for r in runs] == ["all-gpu", "attn-only-nopo", "exps-first3-ub2048", "planner-4G"]
    assert runs[1]["llama_bench_args"][:2] == ["-p", "16"] and "-m" not in runs[1]["llama_bench_args"]
    assert runs[1]["llama_bench_args"][runs[1]["llama_bench_args"].index("-nopo") + 1] == "1"
    assert runs[0]["pp_tps"] == rep["plans"][0]["measurement"]["pp_tps"]
