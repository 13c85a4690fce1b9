"""PP/TG predictor: what llama.cpp does per generated token and per prompt ubatch, term by term, in seconds.

Each term is one thing ggml does (docs/cost_model.md says which code path, with its upstream source) priced
with a ceiling `calibrate` measures (HardwareProfile) times the share of it llama.cpp's kernels reach
(Overheads.*_eff: llama.cpp's own, fitted once on measured runs; calibrate cannot run llama.cpp's kernels).
Each term is keyed by its kind and device (planner.cost_terms.Term); the names below are their text form.

TG (one token, batch 1: no op offload, ggml-backend.cpp compares the batch with the min batch):
  CUDAi_read   weight bytes the token touches on GPU i (n_expert_used / n_expert of an expert tensor)
  CUDAi_kv     the layer's KV cells at the context depth
  cpu_read     the same on the CPU, at the CPU's decode rate for the thread count
  sync         per CPU segment of the graph (ggml_backend_sched splits): its inputs copied from the GPU, each
               with a synchronisation (EngineFacts.split_inputs x a calibrated round trip)
  launch       per-layer kernel launches on the GPU, thread-pool work of layers homed on the CPU

PP (one ubatch of T tokens; a prompt is ceil(n_prompt / T) ubatches):
  CUDAi_compute  GPU matmuls: max(FLOPs / (GEMM rate x gpu_gemm_eff), bytes of the weights (the experts the
                 ubatch routes to) / GPU bandwidth)
  CUDAi_attn     attention over the cells so far (flash attention), or its score matrix passes (without)
  cpu_compute    CPU matmuls (op offload off or batch < min batch): max(FLOPs / CPU GEMM rate, bytes / CPU bw)
  upload         op offload: the host weight copied into the GPU split (MUL_MAT_ID: only the experts the
                 ubatch uses) at pinned or pageable speed
  upload_calls   one cudaMemcpyAsync per contiguous run of used experts
  sync           per MoE layer whose experts are uploaded: the expert ids read back (a D2H copy + stream sync);
                 per CPU segment: its input copies as in TG
  launch         kernel launches (no CUDA graphs at batch > 1) and the extra split per uploaded weight
  CUDAi_output / cpu_output   the output layer, for the prompt's last token only (its share per ubatch)

Both, when the weights in RAM outgrow it (planner.host.HostBill.disk_share; predict's `disk_share`):
  cpu_disk     that share of the weight bytes read from RAM (TG) or read or uploaded from it (PP), read back
               from disk at host.disk_read_bytes_per_s: the page cache cannot hold them, so a token faults them in
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cost_terms import Term, text_keys
from .ggml_types import by_name as ggml_type
from .hardware import HardwareProfile
from .host import disk_share_of
from .memory import KV_TYPE
from .model import ModelInventory, Tensor
from .plan import Plan, gpu_index
from .residency import home_devices, offload_min_batch, output_device, repacked


@dataclass(frozen=True)
class EngineFacts:
    """llama.cpp's per-op counts and scaling rules the hardware profile does not hold (docs/cost_model.md)."""
    pp_gpu_ops_per_layer: int = 24     # ggml nodes a MoE layer launches per ubatch (llama-graph.cpp build_attn +
                                       # build_moe_ffn: norms, 4 projections, rope x2, FA, router, top-k, 3 MUL_MAT_ID,
                                       # GLU, weights, adds); each pays a kernel launch (no CUDA graph at batch > 1)
    nofa_score_passes: float = 4.0     # without flash attention the f32 score matrix [n_kv, T, n_head] is written
                                       # by KQ, read+written by soft_max, read by KQV (llama-graph.cpp build_attn_mha)
    split_inputs: int = 3              # tensors a CPU expert split copies in from the GPU, each a synchronous
                                       # copy (ggml_backend_sched_compute_splits): activations, expert ids, weights
    cpu_thread_exp: float = 0.6531     # CPU matmul time ~ (n_threads_calibrated / n_threads) ** this
    synthetic_expert_pool: float = 10.19  # experts a ubatch's tokens spread over in runtime.synth's random-weight
                                          # models (routing collapses: attention averages random values)
    # attention at depth (fitted on the H100 runs at depth 8192, docs/cost_model.md "Attention over the KV cache")
    tg_kv_eff: float = 0.5134          # share of the GEMV bandwidth the one-token flash-attention kernel reaches
                                       # over the KV cells (fattn-vec: a few heads, split over the cells)
    tg_kv_quant_cost: float = 3.723    # x that time when K/V are quantized (q8_0 ...): dequantised in the kernel
    pp_attn_scale: float = 0.6414      # x the ubatch's attention time at GEMM rate (fattn-mma on tensor cores
                                       # reaches another share of the GEMM ceiling than the quantized matmuls)
    # the edges of the shared runs (fitted with the shares on runs all-GPU and with layers on the CPU too)
    tg_gpu_op_scale: float = 1.518     # a real graph node of a MoE layer against calibrate's trivial kernel in a
                                       # CUDA graph (norms, rope, top-k, MUL_MAT_ID's id sorting: ~2 us, not ~1)
    # mainline --no-host: a weight the CPU backend repacks (planner.residency.repacked) decodes with ggml-cpu's
    # interleaved GEMV kernels; its TG read time x this. Fitted on the H100 runs of 2026-11-24
    # (tests/planner/data/h100_nohost_20261124_runs.jsonl: two placements, --no-host 0/1, two interleaved
    # rounds): TG 1.10x with 29 layers of experts in RAM (predicted 1.11x), 1.11x with 3 (predicted 1.04x)
    cpu_repack_tg_time: float = 0.86


LLAMACPP = EngineFacts()


def distinct_expert_fraction(n_expert: int, n_used: int, n_tokens: int) -> float:
    """Expected share of experts that at least one of n_tokens tokens routes to (uniform routing)."""
    if n_expert == 0:
        return 1.0
    return 1.0 - (1.0 - n_used / n_expert) ** n_tokens


def expert_pool(inv: ModelInventory, facts: EngineFacts = LLAMACPP) -> float:
    """How many experts a ubatch's routing draws from: all of them for a real model; few for the random-weight
    files runtime.synth writes (their general.name starts with "synthetic")."""
    hp = inv.hparams
    if inv.name.startswith("synthetic") and hp.n_expert:
        return max(float(hp.n_expert_used), min(float(hp.n_expert), facts.synthetic_expert_pool))
    return float(hp.n_expert)


def distinct_experts(inv: ModelInventory, n_tokens: int, facts: EngineFacts = LLAMACPP) -> float:
    """Expected number of distinct experts n_tokens tokens route to (uniform over the pool)."""
    hp = inv.hparams
    if not hp.n_expert:
        return 0.0
    pool = expert_pool(inv, facts)
    return pool * (1.0 - (1.0 - hp.n_expert_used / pool) ** n_tokens)


def _expert_runs(n_expert: int, n_used: float) -> float:
    """Expected contiguous runs of used experts among n_expert ids when n_used are used (scattered ids):
    llama.cpp copies each run with one call (ggml_backend_sched_compute_splits copy_experts)."""
    if n_used <= 0:
        return 0.0
    p = min(1.0, n_used / n_expert)
    return max(1.0, n_expert * p * (1.0 - p) + p)


@dataclass(frozen=True)
class Prediction:
    pp_tps: float
    tg_tps: float
    tg_s: float                     # seconds per generated token
    pp_ubatch_s: float              # seconds per ubatch (the prompt's one-off costs spread over its ubatches)
    tg_terms: dict[Term, float] = field(default_factory=dict)   # seconds per term of a generated token
    pp_terms: dict[Term, float] = field(default_factory=dict)   # seconds per term of a prompt ubatch

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds per term as text ({"tg.CUDA0_read": s, "pp.upload": s, ...}): for JSON and reports."""
        return text_keys("tg", self.tg_terms) | text_keys("pp", self.pp_terms)


def _params(t: Tensor) -> int:
    return math.prod(t.shape)


def _host_pinned(plan: Plan) -> bool:
    """CPU weights in pinned memory upload fast; mmap'd (pageable) ones go through a staging copy."""
    has_override = any(dev == "CPU" for name, dev in plan.assignment.items() if name.startswith("blk."))
    if plan.dialect == "mainline" and plan.knobs.no_host:
        return False      # --no-host: no GPU host buffer; what still uploads sits in the plain (pageable) CPU one
    return (not plan.knobs.mmap) or (plan.dialect == "ik" and has_override)


def _kv_bytes_per_cell(inv: ModelInventory, plan: Plan, il: int) -> float:
    hp, knobs = inv.hparams, plan.knobs
    tk, tv = ggml_type(KV_TYPE[knobs.type_k]), ggml_type(KV_TYPE[knobs.type_v])
    hkv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
    if hp.is_mla:
        return tk.row_bytes(hp.mla_kv_lora_rank + hp.n_rot)
    return tk.row_bytes(hkv * hp.head_dim_k) + tv.row_bytes(hkv * hp.head_dim_v)


_EXPERT_ORDER = {"exps_gate": 0, "exps_gate_up": 0, "exps_up": 1, "exps_down": 2}


def _graph_order(inv: ModelInventory) -> list[Tensor]:
    """Layer weights in the order the graph uses them: per layer norms, attention, router, dense/shared FFN, then
    the routed experts gate, up, down (llama-graph.cpp build_moe_ffn). The output comes after (predict)."""
    out: list[Tensor] = []
    for il in inv.layers():
        ts = [t for t in inv.by_layer.get(il, ()) if t.role != "nextn"]
        out += [t for t in ts if not t.is_expert]
        out += sorted((t for t in ts if t.is_expert), key=lambda t: _EXPERT_ORDER.get(t.role, 1))
    return out


def _round_trips(seq: list[str]) -> int:
    """GPU -> CPU -> GPU round trips along a sequence of devices: one per CPU run between GPU runs (ggml's
    scheduler starts a split at every backend change, and each change synchronises)."""
    trips, prev = 0, None
    for dev in seq:
        if prev is not None and prev != dev and dev == "CPU":
            trips += 1
        prev = dev
    if seq and seq[0] == "CPU" and any(d != "CPU" for d in seq):
        trips += 1
    return trips


# one piece: the terms of one forward pass, accumulated section by section (weights in graph order, attention over
# the KV cache, fixed costs) from the same per-plan quantities (devices, ubatch, bandwidths) every section reads
def predict(inv: ModelInventory, plan: Plan, hw: HardwareProfile, n_prompt: int = 512, depth: int = 0,
            facts: EngineFacts = LLAMACPP, disk_share: float | None = None) -> Prediction:
    """`disk_share`: the share of the weights read from RAM that come from disk (planner.host; default: the memory
    model's for `hw`'s RAM, 0 where everything fits)."""
    hp, knobs, ov = inv.hparams, plan.knobs, hw.overheads
    if disk_share is None:
        disk_share = disk_share_of(inv, plan, hw)
    gpus = [d for d in plan.devices() if d != "CPU"]
    homes = home_devices(inv, plan)
    T = max(1, min(knobs.n_ubatch_eff, n_prompt))
    n_ub = max(1, math.ceil(n_prompt / T))
    used_tg = hp.n_expert_used / hp.n_expert if hp.n_expert else 1.0
    used_pp = distinct_experts(inv, T, facts) / hp.n_expert if hp.n_expert else 1.0
    link_bw = hw.link.h2d_pinned if _host_pinned(plan) else hw.link.h2d_pageable
    threads = knobs.n_threads or hw.host.n_threads
    thread_scale = (min(threads, hw.host.n_threads) / max(hw.host.n_threads, 1)) ** facts.cpu_thread_exp
    cpu_bw = hw.host.mem_bw * ov.cpu_eff * thread_scale
    cpu_rate = hw.host.flops * ov.cpu_gemm_eff * thread_scale

    def gpu_of(dev: str):
        return hw.gpus[min(gpu_index(dev), len(hw.gpus) - 1)]

    tg: dict[Term, float] = {}
    pp: dict[Term, float] = {}

    def add(d: dict[Term, float], key: Term, v: float) -> None:
        d[key] = d.get(key, 0.0) + v

    # ---- weights, in graph order: where each op runs at batch 1 (TG) and at batch T (PP)
    out_dev = output_device(inv, plan)
    weights = _graph_order(inv)
    emb = inv.by_name.get("token_embd.weight")
    out_w = inv.by_name.get("output.weight")
    if out_w is None and emb is not None:     # tied: token_embd loaded again as the output, on the output's device
        out_w = Tensor("output.weight", None, "output", emb.shape, emb.ggml_type, emb.nbytes)
    seq_tg: list[str] = []
    seq_pp: list[str] = []
    ram_tg = ram_pp = 0.0                 # weight bytes read from RAM per token / per ubatch (disk_share of them)
    uploaded_moe_layers: set[int] = set()
    gpu_attn_layers: set[int] = set()     # CPU layers whose attention projections run on the GPU (op offload)
    for t in weights:
        dev = plan.assignment.get(t.name, "CPU")
        active = used_tg if t.is_expert else 1.0
        flops_tok = 2 * _params(t) * active            # per token, MAC = 2 flops
        if len(t.shape) < 2:     # norms, biases: read with their layer's ops, never a split of their own
            if dev != "CPU":
                add(tg, Term("read", dev), t.nbytes / (gpu_of(dev).mem_bw * ov.gpu_eff))
            else:
                add(tg, Term("read", "CPU"), t.nbytes / cpu_bw)
                ram_tg += t.nbytes
            continue
        # TG: batch 1 never reaches the offload threshold; the op runs where its weight is
        seq_tg.append(dev)
        if dev != "CPU":
            g = gpu_of(dev)
            add(tg, Term("read", dev), t.nbytes * active / (g.mem_bw * ov.gpu_eff))
        else:
            rp = facts.cpu_repack_tg_time if repacked(plan, t) else 1.0
            add(tg, Term("read", "CPU"), rp * max(t.nbytes * active / cpu_bw, flops_tok / cpu_rate))
            ram_tg += t.nbytes * active
        # PP: T tokens; an expert tensor reads the experts the ubatch routes to (a repacked weight has no offload
        # batch: its op stays on the CPU)
        pp_bytes = t.nbytes * (used_pp if t.is_expert else 1.0)
        if dev != "CPU":
            g = gpu_of(dev)
            add(pp, Term("compute", dev),
                max(T * flops_tok / (g.flops * ov.gpu_gemm_eff), pp_bytes / (g.mem_bw * ov.gpu_eff)))
            seq_pp.append(dev)
            continue
        ram_pp += pp_bytes
        m = offload_min_batch(inv, plan, t)
        if gpus and m is not None and m <= T:
            g = gpu_of(gpus[0])
            add(pp, Term("upload"), pp_bytes / link_bw)
            n_calls = _expert_runs(hp.n_expert, used_pp * hp.n_expert) if t.is_expert else 1.0
            add(pp, Term("upload_calls"), n_calls * hw.link.copy_call_s)
            add(pp, Term("compute", gpus[0]),
                max(T * flops_tok / (g.flops * ov.gpu_gemm_eff), pp_bytes / (g.mem_bw * ov.gpu_eff)))
            add(pp, Term("launch"), ov.launch_s)             # the uploaded weight starts a split of its own
            if t.is_expert and t.layer is not None:
                uploaded_moe_layers.add(t.layer)
            if t.role == "attn" and t.layer is not None:
                gpu_attn_layers.add(t.layer)
            seq_pp.append(gpus[0])
        else:
            add(pp, Term("compute", "CPU"), max(T * flops_tok / cpu_rate, pp_bytes / cpu_bw))
            seq_pp.append("CPU")
    pp[Term("sync")] = len(uploaded_moe_layers) * ov.sync_s

    # output layer: every generated token; in a prompt only its last token (llama-bench, llama-server: logits of
    # the last position), spread over the prompt's ubatches
    if out_w is not None:
        active_flops = 2 * _params(out_w)
        if out_dev != "CPU":
            g = gpu_of(out_dev)
            s = out_w.nbytes / (g.mem_bw * ov.gpu_eff)
            add(tg, Term("read", out_dev), s)
            add(pp, Term("output", out_dev), s / n_ub)
        else:
            s = max(out_w.nbytes / cpu_bw, active_flops / cpu_rate)
            add(tg, Term("read", "CPU"), s * (facts.cpu_repack_tg_time if repacked(plan, out_w) else 1.0))
            add(pp, Term("output", "CPU"), s / n_ub)
            ram_tg += out_w.nbytes
            ram_pp += out_w.nbytes / n_ub
        seq_tg.append(out_dev)
    for t in inv.by_layer.get(None, ()):                # output_norm: read with the output
        if len(t.shape) < 2:
            dev = plan.assignment.get(t.name, "CPU")
            add(tg, Term("read", dev),
                t.nbytes / (gpu_of(dev).mem_bw * ov.gpu_eff if dev != "CPU" else cpu_bw))
    if emb is not None:                                 # GET_ROWS on the CPU: one row per token
        row = emb.nbytes / max(hp.n_vocab, 1)
        add(tg, Term("read", "CPU"), row / cpu_bw)
        add(pp, Term("compute", "CPU"), T * row / cpu_bw)

    # ---- attention over the KV cache: TG reads it; PP multiplies with it (cells so far, on average over the
    # prompt's ubatches: depth + T * (n_ub + 1) / 2)
    ctx_tg = depth + 1
    ctx_pp = depth + T * (n_ub + 1) / 2
    for il in range(hp.n_layer - hp.n_nextn):
        dev = homes[il]
        hkv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
        if hkv == 0:
            continue
        cell = _kv_bytes_per_cell(inv, plan, il)
        dk = (hp.mla_kv_lora_rank + hp.n_rot) if hp.is_mla else hp.head_dim_k
        attn_flops = 4 * T * ctx_pp * hp.n_head * dk
        att_dev = dev
        if dev == "CPU" or knobs.no_kv_offload:
            add(tg, Term("kv", "CPU"), cell * ctx_tg / cpu_bw)
            if il not in gpu_attn_layers or not gpus:
                add(pp, Term("attn", "CPU"), attn_flops / cpu_rate)
                continue
            # its Q/K/V projections were offloaded, so the scheduler grows the GPU split over the weightless
            # attention ops (ggml-backend.cpp, "expand gpu backends"): the cells so far are copied in as split
            # inputs and the attention runs on the GPU
            att_dev = gpus[0]
            add(pp, Term("upload"), cell * ctx_pp / link_bw)
        g = gpu_of(att_dev)
        quant = facts.tg_kv_quant_cost if {knobs.type_k, knobs.type_v} - {"f16", "bf16", "f32"} else 1.0
        if att_dev == dev:
            add(tg, Term("kv", dev), quant * cell * ctx_tg / (g.mem_bw * ov.gpu_eff * facts.tg_kv_eff))
        s = attn_flops / (g.flops * ov.gpu_gemm_eff) + cell * ctx_pp / (g.mem_bw * ov.gpu_eff)
        if not knobs.flash_attn:        # the f32 score matrix goes through memory
            s += facts.nofa_score_passes * 4 * T * ctx_pp * hp.n_head / (g.mem_bw * ov.gpu_eff)
        add(pp, Term("attn", att_dev), s * facts.pp_attn_scale)

    # ---- fixed costs: launches, CPU thread-pool work, device round trips
    n_gpu_layers = sum(1 for h in homes if h != "CPU")
    n_cpu_layers = len(homes) - n_gpu_layers
    tg[Term("launch")] = n_gpu_layers * ov.per_layer_gpu_s * facts.tg_gpu_op_scale + n_cpu_layers * ov.per_layer_cpu_s
    tg[Term("sync")] = _round_trips(seq_tg) * ov.per_split_s * facts.split_inputs
    add(pp, Term("launch"), n_gpu_layers * facts.pp_gpu_ops_per_layer * ov.launch_s + n_cpu_layers * ov.per_layer_cpu_s)
    pp[Term("sync")] += _round_trips(seq_pp) * ov.per_split_s * facts.split_inputs
    if disk_share > 0:           # the weights the RAM cannot hold, read back from the model's file
        disk_bw = hw.host.disk_read_bytes_per_s
        tg[Term("disk", "CPU")] = disk_share * ram_tg / disk_bw
        pp[Term("disk", "CPU")] = disk_share * ram_pp / disk_bw
    tg_s = sum(tg.values())
    pp_s = sum(pp.values())
    return Prediction(pp_tps=n_prompt / max(n_ub * pp_s, 1e-12), tg_tps=1.0 / tg_s, tg_s=tg_s, pp_ubatch_s=pp_s,
                      tg_terms=tg, pp_terms=pp)
