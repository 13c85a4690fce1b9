"""The ik dialect against the real ik_llama.cpp 8337e4cd binaries (CPU build, runtime/ik_build.py).

What a CPU build can show, and what each test checks against our own reading of the flags:
- every flag the ik renderer emits is accepted by llama-cli and llama-bench (exit 0, a token generated or a
  benchmark row written), and the ones that act on a CPU build are read as meant: the -op ids by the names ik
  logs ("Setting offload policy for op MUL_MAT_ID to OFF"), only-active-experts by its log line;
- without a GPU ik turns -ngl into 0 and then drops every -ot and -ncmoe (src/llama.cpp
  llama_model_load_from_file): its loader logs no override at all, which is what our parser says with no GPU;
- a GPU buffer name in -ot is refused by a build without that device, as our parser refuses it for n_gpus=0;
- ik's own buffer sizes (model, KV, compute, MLA's -mla 0/1/2/3 and -amb too) against the memory model's ik dialect,
  the compute buffer to the byte (the size ik mallocs for it, read through a small LD_PRELOAD shim).
GPU-only behaviour (the byte -ts split, -ncmoe over GPUs) is in tests/planner/test_flags_ik.py, from the source.
Every run is tiny (a few-MB synthetic model, -n 1 / -p 8)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from planner.builds import PINNED, from_version
from planner.errors import FlagError
from planner.flags import ik as ik_flags
from planner.flags import parse, render
from planner.ggml_types import by_name
from planner.gguf_header import load_inventory
from planner.memory import estimate
from planner.plan import Knobs, OffloadPolicy, OpRule, Plan
from planner.engine_contract import BenchRun
from runtime.llamacpp import LlamaCppEngine
from runtime.llamacpp_binary import probe
from runtime.llamacpp_output import parse_bench_output
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

pytestmark = pytest.mark.ik
MiB = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ik_models")
    # ik accepts a mainline-converted MLA model (one KV head) only with DeepSeek's own widths: K 576 = kv_lora 512
    # + rope 64, V 512, n_rot 64, heads a multiple of 4 (src/llama-hparams.cpp ~1083, else it aborts)
    ds = dict(kv_lora_rank=512, n_rot=64, head_dim_k=576, head_dim_v=512, head_dim_k_mla=128, head_dim_v_mla=64)
    specs = {"qwen3moe": tiny_spec("qwen3moe"), "gpt-oss": tiny_spec("gpt-oss"),
             "deepseek2": tiny_spec("deepseek2", **ds),
             # 64 heads: KQ and the decompressed K/V pass -amb's 128 MiB floor at a few thousand cells
             "deepseek2-h64": tiny_spec("deepseek2", n_head=64, **ds),
             "llama-mha": tiny_spec("llama", n_head_kv=4)}                # as many K/V heads as Q heads
    return {arch: write_gguf(d / f"{arch}.gguf", spec, uniform_recipe("Q8_0"))[0] for arch, spec in specs.items()}


def run(argv: list[str], timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    # in a temporary folder: ik's programs write llama.log into their working folder
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, errors="replace", timeout=timeout_s,
                          stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir())


def everything_on(inv, device: str = "CPU", **moved: str) -> dict[str, str]:
    a = {t.name: ("CPU" if t.role == "token_embd" else device) for t in inv.allocated()}
    a.update(moved)
    return a


def experts_on_cpu(inv, device: str = "CUDA0", layers=None) -> dict[str, str]:
    return everything_on(inv, device, **{t.name: "CPU" for t in inv.allocated()
                                         if t.is_expert and (layers is None or t.layer in layers)})


MOE_OFF = OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False))


def cases(models):
    """(id, model, plan, flags that must appear in the server/cli line)."""
    q = load_inventory(models["qwen3moe"])
    ds = load_inventory(models["deepseek2"])
    oss = load_inventory(models["gpt-oss"])
    two = dict(everything_on(q, "CUDA0"))
    for t in q.allocated():                    # blocks 1.. and the output on a second GPU: -ngl -ts
        if (t.layer is not None and t.layer >= 1) or t.role in ("output", "output_norm"):
            two[t.name] = "CUDA1"
    return [
        ("op+ooae+cuda", models["qwen3moe"], q,
         Plan("m", experts_on_cpu(q), Knobs(offload=OffloadPolicy(
             dense_matmul=OpRule(True, 64), moe_matmul=OpRule(False, 64), moe_fused_up_gate=OpRule(False, 64),
             output=OpRule(True, 64)), only_active_experts=False, n_threads=1), "ik"),
         ["-op", "-no-ooae", "-cuda", "-cmoe"]),
        ("ot", models["qwen3moe"], q, Plan("m", everything_on(q, "CUDA0", **{"blk.0.ffn_up_exps.weight": "CPU"}),
                                          Knobs(n_threads=1), "ik"), ["-ot"]),
        ("all-op-off", models["qwen3moe"], q, Plan("m", experts_on_cpu(q), Knobs(offload=OffloadPolicy.all(False),
                                                                              n_threads=1), "ik"), ["-op"]),
        ("mla+amb+no-fmoe", models["deepseek2"], ds,
         Plan("m", experts_on_cpu(ds), Knobs(mla=1, amb=512, fmoe=False, flash_attn=False, n_threads=1), "ik"),
         ["-mla", "-amb", "-no-fmoe"]),
        ("rtr+kv-types", models["qwen3moe"], q,
         Plan("m", experts_on_cpu(q), Knobs(rtr=True, mmap=False, type_k="q8_0", type_v="q8_0", n_ubatch=256,
                                            n_threads=1), "ik"), ["-rtr", "-ctk", "-ctv", "-ub"]),
        ("ncmoe", models["qwen3moe"], q, Plan("m", experts_on_cpu(q, layers={1}), Knobs(n_threads=1), "ik"),
         ["-ncmoe"]),
        ("ts", models["qwen3moe"], q, Plan("m", two, Knobs(n_threads=1), "ik"), ["-ts"]),
        ("bias-experts", models["gpt-oss"], oss, Plan("m", experts_on_cpu(oss), Knobs(n_threads=1), "ik"), ["-ngl"]),
    ]


def test_version_names_the_pinned_build(ik_binaries):
    r = run([ik_binaries["llama-cli"], "--version"])
    assert from_version(r.stdout + r.stderr, "ik").number == PINNED["ik"].number
    info = probe(ik_binaries["llama-bench"])
    assert (info.dialect, info.tool, info.output_format) == ("ik", "bench", "json")


def _op_lines(log: str) -> dict[str, str]:
    return dict(re.findall(r"Setting offload policy for op (\w+) to (ON|OFF)", log))


def accepted_by_the_common_parser(cli: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """common.cpp parses argv in order and throws at the first unknown flag or bad value; `--version` last exits
    0 only when everything before it parsed. (llama-cli cannot generate from our synthetic models: they carry no
    tokenizer, and ik's llama-cli asserts on one.)"""
    return run([cli, *argv, "--version"])


def sweep(ik_binaries, argv: list[str]) -> subprocess.CompletedProcess:
    """llama-sweep-bench reads the same flags (random tokens, no tokenizer needed): loads, builds the context."""
    return run([ik_binaries["llama-sweep-bench"], *argv, "-n", "2", "-nrep", "1"])


def test_the_acceptance_check_rejects_what_ik_rejects(ik_binaries, models):
    cli = ik_binaries["llama-cli"]
    assert accepted_by_the_common_parser(cli, ["-m", str(models["qwen3moe"]), "-ngl", "9"]).returncode == 0
    for bad in (["-fmoe"], ["-op", "x"], ["-ot", "exps"], ["-ooae"], ["-mla"]):
        r = accepted_by_the_common_parser(cli, ["-m", str(models["qwen3moe"]), *bad])
        assert r.returncode != 0 and "version: 4840" not in r.stderr, bad


@pytest.mark.slow
def test_every_flag_the_renderer_emits_is_accepted_by_llama_cli(ik_binaries, models):
    names = {v: k for k, v in ik_flags.OP_TABLES["2025-08"].items()}
    for case, path, inv, plan, flags in cases(models):
        rc = render(plan, inv, "cli", model_path=str(path))
        for f in flags:
            assert f in rc, (case, list(rc))
        extra = ["-ger"] if case == "ncmoe" else []       # -ger: accepted, not rendered (not modelled)
        r = accepted_by_the_common_parser(ik_binaries["llama-cli"], [*rc, *extra])
        if case == "ts":
            # a CPU build has llama_max_devices() == 1 and refuses any -ts (common.cpp: size >= max devices);
            # a CUDA build takes up to 16 proportions. The proportions themselves: tests/planner/test_flags_ik.py
            assert r.returncode != 0 and "invalid parameter for argument: -ts" in r.stderr, r.stderr[-500:]
            continue
        assert r.returncode == 0 and "version: 4840" in r.stderr, (case, list(rc), r.stderr[-1000:])
        server = render(plan, inv, "server", model_path=str(path))
        assert list(server) == list(rc)                   # one parser, one line
        r = sweep(ik_binaries, [*rc, *extra])
        log = r.stdout + r.stderr
        assert r.returncode == 0, (case, list(rc), log[-2000:])
        # -op: ik names the ops our table maps the ids to
        if "-op" in rc:
            pairs = rc[rc.index("-op") + 1].split(",")
            want = {names[int(i)]: "OFF" for i in pairs[::2]}
            assert _op_lines(log) == want, (case, _op_lines(log))
        assert ("enabling only_active_experts scheduling" in log) == plan.knobs.only_active_experts, case
        # no GPU: ik runs -ngl 0 and drops every override; our parser, told there is no GPU, says the same
        assert "buffer type overridden" not in log, case
        if not any(d.startswith("CUDA") for o in parse(rc, inv, "ik").overrides for d in [o.device]):
            back = parse(rc, inv, "ik", n_gpus=0)
            assert set(back.assignment.values()) == {"CPU"}, case


def test_every_flag_the_renderer_emits_is_accepted_by_llama_bench(ik_binaries, models):
    for case, path, inv, plan, _flags in cases(models):
        wl = BenchRun(8, 2, 0, 1)
        try:
            rc = render(plan, inv, "bench", bench=wl, model_path=str(path))
        except FlagError as e:               # -op: llama-bench has none (the server/sweep-bench line has it)
            assert "no -op" in str(e) and not plan.knobs.offload.moe_matmul.enabled, case
            continue
        r = run([ik_binaries["llama-bench"], "-o", "json", *rc])
        if case == "ts":           # one device in a CPU build: llama-bench refuses -ts too
            assert r.returncode != 0, (r.stdout + r.stderr)[-500:]
            continue
        assert r.returncode == 0, (case, list(rc), (r.stdout + r.stderr)[-2000:])
        rows = parse_bench_output(r.stdout)      # ik's JSON is not always valid JSON: the engine's reader
        assert [(t.n_prompt, t.n_gen) for t in rows] == [(8, 0), (0, 2)], case
        k, f = plan.knobs, rows[0].fields
        assert (f["n_ubatch"], f["type_k"], f["mla_attn"]) == (k.n_ubatch, k.type_k, k.mla), case


def test_a_gpu_buffer_name_is_refused_by_a_cpu_build_as_our_parser_refuses_it(ik_binaries, models):
    q = load_inventory(models["qwen3moe"])
    args = ["-m", str(models["qwen3moe"]), "-ngl", "99", "-ot", r"blk\.0\.ffn_up_exps=CUDA0"]
    r = accepted_by_the_common_parser(ik_binaries["llama-cli"], args)
    assert r.returncode != 0 and "Available buffer types" in r.stderr
    with pytest.raises(FlagError, match="unknown buffer type 'CUDA0'"):
        parse(args, q, "ik", tool="cli", n_gpus=0)


def test_engine_measures_with_ik_llama_bench_and_sweep_bench(ik_binaries, models):
    q = load_inventory(models["qwen3moe"])
    plan = Plan("m", everything_on(q), Knobs(n_threads=1), "ik")
    bench = LlamaCppEngine(ik_binaries["llama-bench"], timeout_s=300, model_path=models["qwen3moe"])
    m = bench.measure(q, plan, BenchRun(8, 2, 0, 1))
    assert m.ok and m.pp_tps > 0 and m.tg_tps > 0, (m.error, m.raw.get("log_tail"))
    sweep = LlamaCppEngine(ik_binaries["llama-sweep-bench"], timeout_s=300, model_path=models["qwen3moe"])
    assert (sweep.info.tool, sweep.info.dialect) == ("sweep", "ik")
    m = sweep.measure(q, replace(plan, knobs=replace(plan.knobs, offload=MOE_OFF)), BenchRun(32, 4, 0, 1))
    assert m.ok and m.pp_tps > 0 and m.tg_tps > 0, (m.error, m.raw.get("log_tail"))


_BUF = re.compile(r"^\S+:\s+(\S+) (KV |compute |)buffer size =\s+([\d.]+) MiB", re.M)
# ik computes attn_kv_b at load for -mla 0/2/3 (no buffer line; planner/memory.py ik_wkv_b_bytes)
_WKV_B = re.compile(r"^Computed blk\.\d+\.attn_kv_b\.weight as (\d+) x (\d+) of type (\w+) and stored in buffer CPU$",
                    re.M)


def _buffers(log: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for dev, kind, mib in _BUF.findall(log):
        key = f"{dev} {kind.strip() or 'model'}"
        out[key] = out.get(key, 0) + round(float(mib) * MiB)
    return out


# Every malloc of 4 KiB or more, printed before the log line that follows it: ik's CPU buffer type mallocs a
# buffer's size + TENSOR_ALIGNMENT (32) bytes (ggml/src/ggml-backend.cpp:705-707), so the compute buffer's exact
# size is the malloc just before "CPU compute buffer size", less 32. (The programs link ggml statically, libc not.)
_MALLOC_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
static void *(*real_malloc)(size_t);
static __thread int busy;
void *malloc(size_t size) {
    if (!real_malloc) real_malloc = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
    void *p = real_malloc(size);
    if (size >= 4096 && !busy) {
        char line[48];
        busy = 1;
        int n = snprintf(line, sizeof line, "MALLOC %zu\n", size);
        if (write(2, line, n) < 0) {}
        busy = 0;
    }
    return p;
}
"""
CPU_BUFFER_PAD = 32


@pytest.fixture(scope="module")
def malloc_shim(tmp_path_factory) -> Path | None:
    cc = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None or not sys.platform.startswith("linux"):
        return None
    d = tmp_path_factory.mktemp("malloc_shim")
    (d / "shim.c").write_text(_MALLOC_SHIM)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "shim.so"), str(d / "shim.c"), "-ldl"],
                       capture_output=True, text=True)
    return d / "shim.so" if r.returncode == 0 else None


def reserve(ik_binaries, argv: list[str], shim: Path | None) -> str:
    """llama-sweep-bench's log up to its context's buffers and graph (then stopped: at a few thousand cells its sweep
    would fill the whole context on one thread)."""
    env = dict(os.environ, **({"LD_PRELOAD": str(shim)} if shim else {}))
    p = subprocess.Popen([str(ik_binaries["llama-sweep-bench"]), *argv, "-n", "2", "-nrep", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                         errors="replace", cwd=tempfile.gettempdir(), env=env)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "graph splits" in line:
                break
    finally:
        p.kill()
        p.wait(timeout=60)
    return "".join(lines)


def _exact_compute(log: str) -> int | None:
    """The compute buffer's bytes: the last malloc before its log line whose size, less the pad, prints as logged."""
    mallocs: list[int] = []
    for line in log.splitlines():
        if line.startswith("MALLOC "):
            mallocs.append(int(line.split()[1]))
        elif "CPU compute buffer size" in line:
            logged = line.split("=")[1].split()[0]
            return next((m - CPU_BUFFER_PAD for m in reversed(mallocs)
                         if f"{(m - CPU_BUFFER_PAD) / MiB:.2f}" == logged), None)
    return None


DS, DS64 = "deepseek2", "deepseek2-h64"
BUFFER_CASES = {
    "qwen3moe-f16": ("qwen3moe", Knobs(n_ctx=512)),
    "qwen3moe-q8kv": ("qwen3moe", Knobs(n_ctx=1024, type_k="q8_0", type_v="q8_0")),
    "qwen3moe-nofmoe": ("qwen3moe", Knobs(n_ctx=512, fmoe=False)),
    "qwen3moe-ub8-nofa": ("qwen3moe", Knobs(n_ctx=256, n_ubatch=8, flash_attn=False)),   # mask rows padded to 16
    "gpt-oss": ("gpt-oss", Knobs(n_ctx=512)),
    # -amb without flash attention and without GQA: one head at a time (256 MiB of KQ at 32768 cells)
    "llama-mha-nofa-amb128": ("llama-mha", Knobs(n_ctx=32768, flash_attn=False, amb=128)),
    # ik's MLA attention (planner/mla_graph.py IK_MLA): -mla 2/3 with flash attention from 128 tokens: K and V
    # decompressed by wkv_b per group of heads (-amb bounds the group), in the cache type on a CPU build
    "ds-mla3-fa": (DS, Knobs(n_ctx=512, mla=3)),
    "ds-mla2-fa-ub128": (DS, Knobs(n_ctx=1024, n_ubatch=128, mla=2)),
    "ds-mla3-fa-q8kv": (DS, Knobs(n_ctx=512, mla=3, type_k="q8_0", type_v="q8_0")),
    "ds64-mla3-fa-amb128": (DS64, Knobs(n_ctx=8192, mla=3, amb=128)),                # 2 groups of 32 heads
    # -mla 1/3 with flash attention below that: flash attention over the latent cache
    "ds-mla1-fa": (DS, Knobs(n_ctx=512, mla=1)),
    "ds-mla3-fa-ub32": (DS, Knobs(n_ctx=1024, n_ubatch=32, mla=3)),
    # KQ, softmax, KQV over the latent: no flash attention, or -mla 2 with it below 128 tokens (kv^T in the buffer)
    "ds-mla1-nofa": (DS, Knobs(n_ctx=512, mla=1, flash_attn=False)),
    "ds-mla3-nofa-ub8": (DS, Knobs(n_ctx=256, n_ubatch=8, mla=3, flash_attn=False)),
    "ds-mla2-fa-ub32-q8kv": (DS, Knobs(n_ctx=1024, n_ubatch=32, mla=2, type_k="q8_0", type_v="q8_0")),
    "ds-mla2-nofa-ub1": (DS, Knobs(n_ctx=512, n_ubatch=1, mla=2, flash_attn=False)),
    "ds64-mla3-nofa-amb200": (DS64, Knobs(n_ctx=8192, mla=3, amb=200, flash_attn=False)),   # 6 groups of 11 heads
    "ds64-mla1-nofa-amb128": (DS64, Knobs(n_ctx=2048, mla=1, amb=128, flash_attn=False)),
    # -mla 0: K and V of every head in the cache, llm_build_kv's attention (one head at a time under -amb)
    "ds-mla0-fa": (DS, Knobs(n_ctx=512, mla=0)),
    "ds-mla0-nofa": (DS, Knobs(n_ctx=512, mla=0, flash_attn=False)),
    "ds64-mla0-nofa-amb128": (DS64, Knobs(n_ctx=2048, mla=0, amb=128, flash_attn=False)),
}


@pytest.mark.parametrize("case", list(BUFFER_CASES))
def test_model_kv_and_compute_buffers_match_the_memory_model(ik_binaries, models, malloc_shim, case):
    arch, knobs = BUFFER_CASES[case]
    inv = load_inventory(models[arch])
    plan = Plan("m", everything_on(inv), replace(knobs, n_threads=1), "ik")
    rc = render(plan, inv, "server", model_path=str(models[arch]))
    log = reserve(ik_binaries, list(rc), malloc_shim)
    assert "graph splits" in log, log[-2000:]
    bufs = _buffers(log)
    mem = estimate(inv, plan).devices["CPU"]
    # the log prints MiB with 2 decimals: 0.005 MiB each way
    model = sum(v for k, v in bufs.items() if k.endswith(" model"))
    wkv_b = sum(int(b) * by_name(t.upper()).row_bytes(int(a)) for a, b, t in _WKV_B.findall(log))
    assert abs(model + wkv_b - mem.weights) <= MiB // 100, (bufs, wkv_b, mem)
    assert abs(bufs.get("CPU KV", 0) - mem.kv) <= MiB // 100, (bufs, mem)
    # the compute buffer is the replay of ik's graph (planner/llama_graph.py, dialect ik: its fused norm, MoE
    # up/gate and weighted sum, its MLA attention, no graph outputs, ik's input and node order), which ggml-alloc
    # lays out as ik does: to the byte
    exact = _exact_compute(log)
    print(f"ik compute {case}: log {bufs['CPU compute'] / MiB:.2f} MiB ({exact} B), model {mem.compute} B")
    if exact is not None:
        assert exact == mem.compute, (case, exact, mem.compute)
    else:                   # no C compiler for the shim: the log's 2 decimals
        assert f"{bufs['CPU compute'] / MiB:.2f}" == f"{mem.compute / MiB:.2f}", (bufs, mem)
    assert re.search(r"graph nodes\s+=\s+\d+", log)


def test_plan_reads_the_target_build_from_the_binary(ik_binaries, capsys):
    from offload_tuner.cli import main
    from runtime.llamacpp_binary import build_of_binary
    assert build_of_binary(ik_binaries["llama-cli"]).number == 4840
    assert build_of_binary(ik_binaries["llama-cli"]).dialect == "ik"
    assert main(["plan", "preset:Qwen3-30B-A3B", "--gpu", "8GiB", "--dialect", "ik",
                 "--build", str(ik_binaries["llama-cli"])]) == 0
    assert "target:   ik build 4840 (version 4840 (8337e4cd))" in capsys.readouterr().out
    assert main(["plan", "preset:Qwen3-30B-A3B", "--gpu", "8GiB", "--build", str(ik_binaries["llama-cli"])]) == 2
    assert "say --dialect ik" in capsys.readouterr().err
