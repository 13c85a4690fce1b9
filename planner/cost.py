"""PP/TG predictor: roofline terms per device, with coefficients (HardwareProfile.overheads) that calibration fits.

TG (one token): every device reads the weight bytes the token touches (all of a dense weight; n_expert_used /
n_expert of an expert tensor; one row of token_embd) plus its layers' KV at the given depth, at that device's
effective bandwidth; devices run one after another (ggml's splits are sequential), and every change of device
costs a synchronisation. Ops on RAM-resident weights never offload at batch 1.

PP (one ubatch of T tokens): per weight, a GPU-resident op costs max(flops / GPU rate, bytes / GPU bandwidth);
a RAM-resident op costs max(flops / CPU rate, bytes / CPU bandwidth) on the CPU, or, when op offload applies at
batch T, the upload of the bytes it needs (all, or the distinct experts the ubatch routes to) over PCIe at
pinned or pageable speed plus the GPU's time. Attention adds 4 * T * context * heads * head_dim flops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .hardware import HardwareProfile
from .memory import home_devices, offload_min_batch, output_device
from .model import ModelInventory, Tensor
from .plan import Plan


@dataclass(frozen=True)
class Prediction:
    pp_tps: float
    tg_tps: float
    tg_s: float                     # seconds per generated token
    pp_ubatch_s: float              # seconds per ubatch
    breakdown: dict[str, float] = field(default_factory=dict)   # seconds per term, TG and PP


def distinct_expert_fraction(n_expert: int, n_used: int, n_tokens: int) -> float:
    """Expected share of experts that at least one of n_tokens tokens routes to (uniform routing)."""
    if n_expert == 0:
        return 1.0
    return 1.0 - (1.0 - n_used / n_expert) ** n_tokens


def _params(t: Tensor) -> int:
    return math.prod(t.shape)


def _host_pinned(plan: Plan) -> bool:
    """CPU weights in pinned memory upload fast; mmap'd (pageable) ones go through a staging copy."""
    has_override = any(dev == "CPU" for name, dev in plan.assignment.items() if name.startswith("blk."))
    return (not plan.knobs.mmap) or (plan.dialect == "ik" and has_override)


def _kv_bytes_per_cell(inv: ModelInventory, il: int) -> int:
    hp = inv.hparams
    hkv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
    if hp.is_mla:
        return 2 * (hp.mla_kv_lora_rank + hp.n_rot)
    return 2 * hkv * (hp.head_dim_k + hp.head_dim_v)


def _splits(inv: ModelInventory, plan: Plan, batch: int) -> int:
    """Device changes along one forward pass: where consecutive weights' ops run on different devices."""
    seq = []
    gpus = [d for d in plan.devices() if d != "CPU"]
    for t in inv.allocated():
        if t.role in ("norm", "other", "nextn") or len(t.shape) < 2:
            continue
        dev = plan.assignment.get(t.name, "CPU")
        if dev == "CPU" and gpus:
            m = offload_min_batch(inv, plan, t)
            if m is not None and batch >= m:
                dev = gpus[0]
        if not seq or seq[-1] != dev:
            seq.append(dev)
    return max(len(seq) - 1, 0)


def predict(inv: ModelInventory, plan: Plan, hw: HardwareProfile, n_prompt: int = 512, depth: int = 0) -> Prediction:
    hp, knobs, ov = inv.hparams, plan.knobs, hw.overheads
    gpus = [d for d in plan.devices() if d != "CPU"]
    homes = home_devices(inv, plan)
    frac_tg = hp.n_expert_used / hp.n_expert if hp.n_expert else 1.0
    T = max(1, min(knobs.n_ubatch_eff, n_prompt))
    frac_pp = distinct_expert_fraction(hp.n_expert, hp.n_expert_used, T) if knobs.only_active_experts else 1.0
    link_bw = hw.link.h2d_pinned if _host_pinned(plan) else hw.link.h2d_pageable
    cpu_threads = knobs.n_threads or hw.host.n_threads
    cpu_scale = min(1.0, cpu_threads / max(hw.host.n_threads, 1))
    cpu_bw = hw.host.mem_bw * ov.cpu_eff * min(1.0, 0.25 + 0.75 * cpu_scale)   # bandwidth saturates early
    cpu_flops = hw.host.flops * cpu_scale

    def gpu_of(dev: str):
        return hw.gpus[min(int(dev[4:]), len(hw.gpus) - 1)]

    tg: dict[str, float] = {}
    pp: dict[str, float] = {}

    def add(d: dict[str, float], key: str, v: float) -> None:
        d[key] = d.get(key, 0.0) + v

    out_dev = output_device(inv, plan)
    weights = list(inv.allocated())
    if inv.tied_output:
        weights.append(Tensor("output.weight", None, "output", inv.by_name["token_embd.weight"].shape,
                              inv.by_name["token_embd.weight"].ggml_type, inv.by_name["token_embd.weight"].nbytes))
    for t in weights:
        dev = out_dev if (inv.tied_output and t.name == "output.weight") else plan.assignment.get(t.name, "CPU")
        if t.role == "token_embd":
            row = t.nbytes / max(hp.n_vocab, 1)
            add(tg, "cpu_read", row / cpu_bw)
            add(pp, "cpu_read", T * row / cpu_bw)
            continue
        active = frac_tg if t.is_expert else 1.0
        flops_tok = 2 * _params(t) * active            # per token, MAC = 2 flops
        tg_bytes = t.nbytes * active
        if dev != "CPU":
            g = gpu_of(dev)
            add(tg, f"{dev}_read", tg_bytes / (g.mem_bw * ov.gpu_eff))
            pp_bytes = t.nbytes * (frac_pp if t.is_expert else 1.0)
            add(pp, f"{dev}_compute", max(T * flops_tok / g.flops, pp_bytes / (g.mem_bw * ov.gpu_eff)))
            continue
        add(tg, "cpu_read", max(tg_bytes / cpu_bw, flops_tok / cpu_flops))
        m = offload_min_batch(inv, plan, t)
        if gpus and m is not None and T >= m:
            g = gpu_of(gpus[0])
            up = t.nbytes * (frac_pp if (t.is_expert and knobs.only_active_experts) else 1.0)
            add(pp, "upload", up / link_bw)
            add(pp, f"{gpus[0]}_compute", T * flops_tok / g.flops)
        else:
            pp_bytes = t.nbytes * (frac_pp if t.is_expert else 1.0)
            add(pp, "cpu_compute", max(T * flops_tok / cpu_flops, pp_bytes / cpu_bw))

    # attention over the KV cache: TG reads it; PP multiplies with it
    ctx_tg = depth + 1
    ctx_pp = depth + T / 2
    for il in range(hp.n_layer - hp.n_nextn):
        dev = homes[il]
        kv_read = _kv_bytes_per_cell(inv, il) * ctx_tg
        dk = (hp.mla_kv_lora_rank + hp.n_rot) if hp.is_mla else hp.head_dim_k
        attn_flops = 4 * T * ctx_pp * hp.n_head * dk
        if dev == "CPU" or knobs.no_kv_offload:
            add(tg, "cpu_kv", kv_read / cpu_bw)
            add(pp, "cpu_attn", attn_flops / cpu_flops)
        else:
            g = gpu_of(dev)
            add(tg, f"{dev}_kv", kv_read / (g.mem_bw * ov.gpu_eff))
            add(pp, f"{dev}_attn", attn_flops / g.flops)

    n_gpu_layers = sum(1 for h in homes if h != "CPU")
    n_cpu_layers = len(homes) - n_gpu_layers
    tg["launch"] = n_gpu_layers * ov.per_layer_gpu_s + n_cpu_layers * ov.per_layer_cpu_s
    tg["sync"] = _splits(inv, plan, 1) * ov.per_split_s
    pp["sync"] = _splits(inv, plan, T) * ov.per_split_s + tg["launch"]
    tg_s = sum(tg.values())
    pp_s = sum(pp.values())
    n_ub = math.ceil(n_prompt / T)
    pp_total = pp_s * n_prompt / (T * 1.0) if n_prompt >= T else pp_s
    breakdown = {f"tg.{k}": v for k, v in tg.items()} | {f"pp.{k}": v for k, v in pp.items()}
    return Prediction(pp_tps=n_prompt / max(pp_total, 1e-12) if n_ub else 0.0, tg_tps=1.0 / tg_s, tg_s=tg_s,
                      pp_ubatch_s=pp_s, breakdown=breakdown)
