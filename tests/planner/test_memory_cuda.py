"""planner.memory against a real CUDA llama.cpp, from captured logs (no GPU or llama.cpp needed here).

tests/planner/data/cuda_h100_llamabench_cases.log holds llama-bench -v runs of the CUDA build of llama.cpp
(llama-cpp-python 0.3.36, sm_90, one H100) on runtime.synth's tiny models (F16 weights): partial -ngl, experts
in RAM with and without op offload, ubatch under the op-offload threshold, -nkvo, -ngl 0, quantized KV, MLA,
SWA. The memory model must reproduce each device's weights, KV and compute buffers (CUDA0 and the CUDA_Host
buffer of the CPU backend) from the same placement.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from planner.archs import build_inventory
from planner.memory import compute_bytes, kv_bytes, weight_bytes
from planner.model import ModelInventory
from planner.plan import Knobs, OffloadPolicy, Plan
from runtime.llamacpp_logs import RESOLUTION_2DP, parse_log
from runtime.synth import tiny_spec, uniform_recipe

LOG = Path(__file__).resolve().parent / "data" / "cuda_h100_llamabench_cases.log"
MiB = 1 << 20


@dataclass(frozen=True)
class CudaCase:
    id: str
    arch: str
    args: tuple[str, ...]
    log: str

    def arg(self, flag: str, default: str | None = None) -> str | None:
        return self.args[self.args.index(flag) + 1] if flag in self.args else default


def _cases() -> list[CudaCase]:
    text = LOG.read_text()
    found = re.findall(r"=== CASE (\S+) (\S+) (.*?)\n(.*?)=== END", text, re.S)
    return [CudaCase(cid, arch, tuple(args.split()), body) for cid, arch, args, body in found]


CASES = _cases()


def cuda_plan(inv: ModelInventory, case: CudaCase) -> Plan:
    """The placement llama-bench made: mainline -ngl N takes the last N of the n_layer_all + 1 slots, the
    output layer first (a NextN block is a slot, though never allocated); token_embd stays in RAM; -ot REGEX=CPU
    overrides (regex_search on the tensor name)."""
    n_slots = inv.n_layer                       # block_count, NextN blocks included
    ngl = int(case.arg("-ngl", "99"))
    gpu_layers = set(range(max(0, n_slots - (ngl - 1)), n_slots)) if ngl >= 1 else set()
    pattern, _, buft = (case.arg("-ot") or "").partition("=")

    def where(t) -> str:
        if pattern and re.search(pattern, t.name):
            return buft
        if t.role == "token_embd":
            return "CPU"
        if t.layer is None:
            return "CUDA0" if ngl >= 1 else "CPU"
        return "CUDA0" if t.layer in gpu_layers else "CPU"

    knobs = Knobs(n_ctx=int(case.arg("-p")), n_batch=int(case.arg("-b", "2048")), n_ubatch=int(case.arg("-ub")),
                  flash_attn=case.arg("-fa") == "1", type_k=case.arg("-ctk", "f16"), type_v=case.arg("-ctv", "f16"),
                  no_kv_offload=case.arg("-nkvo") == "1", offload=OffloadPolicy.all(case.arg("-nopo") != "1"))
    return Plan(f"tiny-{case.arch}", {t.name: where(t) for t in inv.allocated()}, knobs)


@pytest.fixture(scope="module")
def cuda_table(request: pytest.FixtureRequest):
    rows: list[tuple[str, dict[str, tuple[int, int]]]] = []
    yield rows
    lines = ["", "memory model vs llama.cpp CUDA (H100 logs; compute buffers in MiB, ours / theirs)",
             "| case | flags | CUDA0 compute | CUDA_Host compute |", "|---|---|---|---|"]
    for cid, r in rows:
        cells = [f"{r[d][0] / MiB:.4f} / {r[d][1] / MiB:.4f}" for d in ("CUDA0", "CPU")]
        case = next(c for c in CASES if c.id == cid)
        lines.append(f"| {cid} | {case.arch} {' '.join(case.args)} | {cells[0]} | {cells[1]} |")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print("\n".join(lines), flush=True)


def test_the_fixture_holds_the_cases():
    assert len(CASES) >= 20
    assert {c.arch for c in CASES} >= {"qwen3moe", "qwen2moe", "deepseek2", "gpt-oss", "glm4moe", "llama"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cuda_buffers_match(case: CudaCase, cuda_table):
    log = parse_log(case.log)
    ctx = log.context
    inv = build_inventory(tiny_spec(case.arch), uniform_recipe("F16"))
    plan = cuda_plan(inv, case)
    comp = compute_bytes(inv, plan, gpus=("CUDA0",))
    theirs = {"CUDA0": ctx.compute("CUDA0"), "CPU": ctx.compute("CUDA_Host")}
    cuda_table.append((case.id, {d: (comp.get(d, 0), theirs[d]) for d in theirs}))
    for dev, buft in (("CUDA0", "CUDA0"), ("CPU", "CUDA_Host")):
        tol = 0.01 * theirs[dev] + ctx.compute_resolution(buft)
        assert abs(comp.get(dev, 0) - theirs[dev]) <= tol, f"{dev} compute ours {comp.get(dev, 0)} theirs {theirs[dev]}"
    # GPU weights and KV: the CUDA0 buffers are exactly the tensors placed there
    assert abs(weight_bytes(inv, plan).get("CUDA0", 0) - log.model_buffers.get("CUDA0", 0)) <= RESOLUTION_2DP
    kv_theirs = ctx.kv_buffers.get("CUDA0", 0)
    assert abs(kv_bytes(inv, plan).get("CUDA0", 0) - kv_theirs) <= 0.01 * kv_theirs + 2 * RESOLUTION_2DP
