"""planner.memory against the real thing: tiny synthetic GGUFs through the CPU llama-bench (llama.cpp of
llama-cpp-python 0.3.36), its load/context log parsed (runtime.llamacpp_logs), every tensor on "CPU".

What is compared (ours / theirs):
- weights: memory.weight_bytes (sum of the allocated tensors) / the model buffers llama.cpp logs. With mmap the
  CPU_Mapped buffer is the file range from its first to its last tensor (llama-model-loader.cpp
  get_mapping_range), so it also counts the alignment padding between tensors and whatever else lies in that
  range: a skipped NextN layer (glm4moe), the file bytes of weights repacked into CPU_REPACK. Without mmap
  (-lm none) the CPU buffer is the tensors' sum. The test derives that slack from the file header and allows
  exactly it plus the log's rounding.
- KV: memory.kv_bytes / the KV buffers (both caches of an SWA model): within 1% (or the log's rounding).
- compute: memory.compute_bytes / the CPU compute buffer (the destructor's 4-decimal debug line): within 10%.

Run with -s or look at the end of the output for the error table (case | weights | KV | compute).
"""
from __future__ import annotations

import contextlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from planner.gguf_header import load_inventory, read_header
from planner.memory import estimate
from planner.plan import Knobs, Plan
from runtime.llamacpp_logs import RESOLUTION_2DP, parse_log, parse_repacked_tensors
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

pytestmark = pytest.mark.llamacpp
MiB = 1 << 20


@dataclass(frozen=True)
class Case:
    id: str
    arch: str
    n_ctx: int                  # llama-bench context = n_prompt (-p) + n_gen (0)
    n_ubatch: int = 512
    n_batch: int = 2048
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    quant: str = "F16"          # weights (routers, norms, biases stay F32)
    tied: bool = False          # no output.weight
    mmap: bool = True           # False: -lm none

    @property
    def knobs(self) -> Knobs:
        return Knobs(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch, flash_attn=self.flash_attn,
                     type_k=self.type_k, type_v=self.type_v, mmap=self.mmap)


CASES = [
    Case("qwen3moe-fa", "qwen3moe", 512),
    Case("qwen3moe-nofa-ub256", "qwen3moe", 1024, n_ubatch=256, flash_attn=False),
    Case("qwen3moe-q8kv-ctx4096", "qwen3moe", 4096, type_k="q8_0", type_v="q8_0"),
    Case("qwen3moe-tied-q8w-nommap", "qwen3moe", 768, n_ubatch=384, quant="Q8_0", tied=True, mmap=False),
    Case("qwen2moe-shexp-q4kv", "qwen2moe", 4096, n_ubatch=384, type_k="q4_0", type_v="q4_0"),
    Case("qwen2moe-nofa-b128", "qwen2moe", 1024, n_batch=128, flash_attn=False),
    Case("deepseek2-mla-fa", "deepseek2", 1536),
    Case("deepseek2-mla-nofa-ub256", "deepseek2", 1024, n_ubatch=256, flash_attn=False),
    Case("deepseek2-mla-q8kv", "deepseek2", 2048, type_k="q8_0", type_v="q8_0"),
    Case("gptoss-swa-ctx2048", "gpt-oss", 2048),
    Case("gptoss-swa-ctx4096-ub256-q8kv", "gpt-oss", 4096, n_ubatch=256, type_k="q8_0", type_v="q8_0"),
    Case("gptoss-ctx300-nofa", "gpt-oss", 300, flash_attn=False),
    Case("glm4moe-nextn-q8kv-ub128", "glm4moe", 2048, n_ubatch=128, type_k="q8_0", type_v="q8_0"),
    Case("glm4moe-nextn-nofa", "glm4moe", 1024, flash_attn=False),
    Case("llama-b128-ub512", "llama", 1024, n_batch=128),
    Case("llama-tied-ctx100-nofa", "llama", 100, flash_attn=False, tied=True),
    Case("llama-q4w-repack", "llama", 512, n_ubatch=256, quant="Q4_0"),
]


@dataclass(frozen=True)
class Row:
    case: str
    weights: tuple[int, int]
    kv: tuple[int, int]
    compute: tuple[int, int]
    layout_slack: int           # bytes llama.cpp's model buffers count beyond the tensors (from the file)


@pytest.fixture(scope="module")
def error_table(request: pytest.FixtureRequest):
    rows: list[Row] = []
    yield rows
    if not rows:
        return

    def mib(b: int) -> str:
        return f"{b / MiB:.4f}"

    def err(ours: int, theirs: int) -> str:
        return f"{100 * (ours - theirs) / theirs:+.2f}%" if theirs else "n/a"

    lines = ["", "memory model vs llama.cpp (CPU build; MiB; theirs: weights and KV as logged to 2 decimals, "
             "compute to 4; err = (ours - theirs) / theirs)",
             "| case | weights ours/theirs | file-layout slack in theirs | KV ours/theirs/err% | "
             "compute ours/theirs/err% |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.case} | {mib(r.weights[0])} / {mib(r.weights[1])} | {mib(r.layout_slack)} | "
                     f"{mib(r.kv[0])} / {mib(r.kv[1])} / {err(*r.kv)} | "
                     f"{mib(r.compute[0])} / {mib(r.compute[1])} / {err(*r.compute)} |")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print("\n".join(lines), flush=True)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory):
    made: dict[tuple, Path] = {}

    def get(case: Case) -> Path:
        key = (case.arch, case.quant, case.tied)
        if key not in made:
            out = tmp_path_factory.mktemp("models") / f"{case.arch}-{case.quant}{'-tied' if case.tied else ''}.gguf"
            made[key] = write_gguf(out, tiny_spec(case.arch), uniform_recipe(case.quant), tied_output=case.tied)[0]
        return made[key]
    return get


def run_llama_bench(bench: Path, model: Path, case: Case) -> str:
    cmd = [str(bench), "-m", str(model), "-p", str(case.n_ctx), "-n", "0", "-ub", str(case.n_ubatch),
           "-b", str(case.n_batch), "-ctk", case.type_k, "-ctv", case.type_v, "-fa", "1" if case.flash_attn else "0",
           "-lm", "mmap" if case.mmap else "none", "-t", "2", "-r", "1", "--no-warmup", "-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}"
    return r.stderr


def expected_model_buffers(path: Path, allocated: set[str], repacked: tuple[str, ...], mmap: bool) -> int:
    """What llama.cpp's model buffers add up to, from the file layout: the mapped range [first, last) of the
    tensors left in the CPU buffer (mmap) or their sum (no mmap), plus the repacked tensors' copies."""
    header = read_header(path)
    in_buffer = [t for t in header.tensors if t.name in allocated and t.name not in repacked]
    repack = sum(t.nbytes for t in header.tensors if t.name in repacked)
    if not mmap:
        return sum(t.nbytes for t in in_buffer) + repack
    return max(t.offset + t.nbytes for t in in_buffer) - min(t.offset for t in in_buffer) + repack


SLOW_CASES = {"qwen2moe-shexp-q4kv", "deepseek2-mla-q8kv", "qwen3moe-q8kv-ctx4096"}   # > 3 s each on 2 cores


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.id in SLOW_CASES else [])
                                  for c in CASES])
def test_memory_model_matches_llama_cpp(case: Case, llama_bench: Path, model_file, error_table: list[Row]):
    path = model_file(case)
    text = run_llama_bench(llama_bench, path, case)
    log = parse_log(text)
    ctx = log.context
    knobs = case.knobs
    # the context llama.cpp made is the one we model (llama-context.cpp: n_ctx padded to 256, ubatch clamped)
    assert ctx.cparam("n_ctx") == knobs.kv_size
    assert ctx.cparam("n_ubatch") == knobs.n_ubatch_eff
    assert ctx.cparams["flash_attn"] == ("enabled" if case.flash_attn else "disabled")

    inv = load_inventory(path)
    plan = Plan(f"tiny-{case.arch}", {t.name: "CPU" for t in inv.allocated()}, knobs)
    ours = estimate(inv, plan).devices["CPU"]

    theirs_weights = log.model_bytes
    theirs_kv = ctx.kv_bytes
    theirs_compute = ctx.compute("CPU")
    repacked = parse_repacked_tensors(text)
    expected = expected_model_buffers(path, {t.name for t in inv.allocated()}, repacked, case.mmap)
    error_table.append(Row(case.id, (ours.weights, theirs_weights), (ours.kv, theirs_kv),
                           (ours.compute, theirs_compute), expected - ours.weights))

    # weights: our sum of tensors; llama.cpp's buffers are that plus the file-layout slack named above
    rounding = len(log.model_buffers) * RESOLUTION_2DP
    assert ours.weights == sum(t.nbytes for t in inv.allocated())
    assert abs(theirs_weights - expected) <= rounding
    assert ours.weights <= theirs_weights + rounding
    if not case.mmap and not repacked:
        assert abs(theirs_weights - ours.weights) <= rounding      # no mapping: exactly the tensors

    # KV within 1% (the "%.2f MiB" lines round to 0.005 MiB per buffer: allowed on top)
    kv_tol = 0.01 * theirs_kv + len(ctx.kv_caches) * RESOLUTION_2DP
    assert abs(ours.kv - theirs_kv) <= kv_tol, f"KV ours {ours.kv} theirs {theirs_kv}"

    # compute within 10%
    assert theirs_compute > 0
    assert abs(ours.compute - theirs_compute) <= 0.10 * theirs_compute, \
        f"compute ours {ours.compute} theirs {theirs_compute}"
