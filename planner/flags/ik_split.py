"""ik_llama.cpp's layer split over several GPUs: -ts divides cumulative layer BYTES, not layer counts.

Source: ik_llama.cpp 8337e4cd, src/llama.cpp get_layer_sizes (~3938-4172) and llm_load_tensors (~4387-4465),
since ik PR 1466 (build 4327; planner/builds.py Feature.TS_BY_LAYER_BYTES). In our words:
- Every block has a size: all its weights from the file (experts included, even those an -ot sends to RAM; NextN
  blocks count nothing), plus, for MLA models, the wk_b/wv_b (or wkv_b halves) ik builds at load, plus the
  block's KV cache for `max_ctx_size` cells (the server's -c; 0 in llama-bench, which leaves it unset).
  The output slot is output.weight (token_embd when tied) plus max(n_vocab * n_ubatch * 4, C) - C, where C is
  the largest per-block compute estimate: max(expert, shared-expert, dense FFN rows * n_ubatch * 4 [* n_used])
  + n_embd * n_ubatch * 4 (x2 with norms), and for -mla 3 the f32 K/V of the attention (split by -amb).
- The proportions are normalised to cumulative float32 split points s_d. Going through the devices, each first
  adds C to a float32 running total, then takes blocks from i_gpu_start on while total + size <= s_d * S
  (S = C * n_devices + the sizes of the GPU slots), plus one more if that overshoots less than it undershoots.
  Blocks no device took stay on the LAST device. The output slot is split like a block when -ngl > n_layer.
llama-bench builds its model parameters without max_ctx_size, n_ubatch or -amb (examples/llama-bench: the
library defaults 0, 512, 256 apply), so the same -ts splits differently there than in the server.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np

from ..errors import FlagError
from ..ggml_types import by_name
from ..model import ModelInventory, Tensor
from ..plan import Knobs
from .common import split_points

F32 = 4
_KV_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
            "q5_0": "Q5_0", "q5_1": "Q5_1", "iq4_nl": "IQ4_NL"}
_EXPS = ("exps_gate", "exps_up", "exps_down", "exps_gate_up")
# llama_model_default_params (src/llama.cpp ~7508): what llama-bench leaves unset
_BENCH_N_UBATCH, _BENCH_AMB = 512, 256


@dataclass(frozen=True)
class SizeParams:
    """The model parameters get_layer_sizes reads (llama_model_params of the tool)."""
    max_ctx_size: int
    n_ubatch: int
    type_k: str
    type_v: str
    mla: int
    amb: int
    flash_attn: bool

    @classmethod
    def of(cls, knobs: Knobs, tool: str, ctx_given: bool = True) -> SizeParams:
        if tool == "bench":
            return cls(0, _BENCH_N_UBATCH, knobs.type_k, knobs.type_v, knobs.mla, _BENCH_AMB, True)
        # common.cpp: max_ctx_size = -c (0 without one), n_ubatch = min(-ub, min(-b, -c)), amb = -amb
        return cls(knobs.n_ctx if ctx_given else 0, knobs.n_ubatch_eff, knobs.type_k, knobs.type_v, knobs.mla,
                   knobs.amb, knobs.flash_attn)


def _row(type_name: str, n: int) -> int:
    return by_name(_KV_TYPE.get(type_name, type_name.upper())).row_bytes(n)


def _kv_bytes(inv: ModelInventory, il: int, p: SizeParams) -> int:
    """llama_model::cache_size (src/llama-model.cpp ~2463) for a plain or MLA attention layer."""
    hp = inv.hparams
    n = p.max_ctx_size
    if hp.is_mla and p.mla:
        width = hp.mla_kv_lora_rank + hp.n_rot
        if p.flash_attn:
            return _row(p.type_k, width) * n
        size = _row(p.type_k if p.mla == 1 else p.type_v, width) * n
        if p.mla == 1:
            size += _row(p.type_v, hp.mla_kv_lora_rank * n)
        return size
    n_kv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
    return _row(p.type_k, hp.head_dim_k) * n_kv * n + _row(p.type_v, hp.head_dim_v * n_kv) * n


def _ne1(t: Tensor) -> int:
    return t.shape[1] if len(t.shape) > 1 else 1


def _suffix(t: Tensor) -> str:
    return t.name.split(".", 2)[2] if t.layer is not None else t.name


def layer_sizes(inv: ModelInventory, p: SizeParams) -> tuple[list[float], float]:
    """(bytes per slot, index n_layer = output; the largest compute estimate C), as get_layer_sizes computes."""
    hp = inv.hparams
    n_layer = hp.n_layer
    first_nextn = n_layer - hp.n_nextn
    weights = [0.0] * (n_layer + 1)
    compute = [0.0] * n_layer
    ub = p.n_ubatch
    for il in range(n_layer):
        tensors = inv.by_layer.get(il, ())
        if il >= first_nextn:
            continue
        ffn = {"exps": 0, "shexp": 0, "dense": 0}
        norms = False
        mla: dict[str, Tensor] = {}
        for t in tensors:
            weights[il] += t.nbytes
            suf = _suffix(t)
            if suf.endswith((".bias", ".scale")):
                continue
            stem = suf.rsplit(".", 1)[0]
            if stem in ("attn_k_b", "attn_v_b", "attn_kv_b"):
                mla[stem] = t
            elif t.role in _EXPS:
                ffn["exps"] += _ne1(t) * ub * hp.n_expert_used * F32
            elif t.role == "ffn_shexp" and stem != "ffn_gate_inp_shexp":
                ffn["shexp"] += _ne1(t) * ub * F32
            elif t.role == "ffn_dense":
                ffn["dense"] += _ne1(t) * ub * F32
            elif t.role == "norm":
                norms = True
        inp = hp.n_embd * ub * F32 * (2 if norms else 1)
        compute[il] = max(ffn.values()) + inp
        if hp.is_mla and mla:
            wk_b, wv_b, wkv_b = mla.get("attn_k_b"), mla.get("attn_v_b"), mla.get("attn_kv_b")
            if wk_b is not None and wv_b is not None and wkv_b is None:
                # ik rebuilds wkv_b (Q8_0 when quantized) from wk_b and wv_b
                q8 = by_name("Q8_0") if by_name(wk_b.ggml_type).block > 1 else by_name(wk_b.ggml_type)
                n_head = wv_b.shape[2] if len(wv_b.shape) > 2 else 1
                weights[il] += q8.row_bytes(wv_b.shape[0]) * (wv_b.shape[1] + wk_b.shape[1]) * n_head * 2
            elif wkv_b is not None:
                weights[il] += (wkv_b.nbytes // 2 if wk_b is None else 0) + (wkv_b.nbytes // 2 if wv_b is None else 0)
            if p.mla == 3 and wv_b is not None:
                n_head = wv_b.shape[2] if len(wv_b.shape) > 2 else 1
                kv_mib = 2 * wv_b.shape[1] * n_head * p.max_ctx_size * F32 / (1024.0 * 1024.0)
                n_max_head = n_head
                if p.amb > 0 and kv_mib > p.amb:
                    n_max_head = 1
                    for niter in range(2, n_head):
                        if n_head % niter == 0 and kv_mib / niter <= p.amb:
                            n_max_head = n_head // niter
                            break
                compute[il] = max(compute[il], 2.0 * wv_b.shape[1] * n_max_head * p.max_ctx_size * F32)
    out_t = inv.by_name.get("output.weight") or inv.by_name.get("token_embd.weight")
    weights[n_layer] = float(out_t.nbytes if out_t is not None else 0)
    max_compute = max(compute, default=0.0)
    for il in range(n_layer):
        weights[il] += _kv_bytes(inv, il, p)
    output = max(float(hp.n_vocab * ub * F32), max_compute) - max_compute
    weights[n_layer] += output
    return weights, max_compute


def _f32(x: float) -> float:
    return float(np.float32(x))


def split_slots(n_layer: int, n_gpu_layers: int, devices: Sequence[str], tensor_split: Sequence[float] | None,
                sizes: Sequence[float], max_compute: float) -> list[str]:
    """Device of each of the n_layer + 1 slots under ik's byte split (index n_layer = output layer)."""
    out = ["CPU"] * (n_layer + 1)
    ngl = max(n_gpu_layers, 0)
    if not devices or ngl == 0:
        return out
    start = max(n_layer - ngl, 0)
    n_dev = len(devices)
    dev_of = [n_dev - 1] * (n_layer + 1)          # default_layer_device: the last device
    if n_dev > 1:
        splits = split_points(tensor_split, n_dev)
        n_last = n_layer + (1 if ngl > n_layer else 0)
        total = max_compute * n_dev + sum(sizes[start:n_last])
        last = start
        loaded = _f32(0.0)
        for d in range(n_dev):
            loaded = _f32(loaded + max_compute)
            split_size = _f32(float(splits[d]) * total)
            il = last
            while il < n_last:
                if loaded + sizes[il] <= split_size:
                    dev_of[il] = d
                    loaded = _f32(loaded + sizes[il])
                    il += 1
                    continue
                if loaded + sizes[il] - split_size < split_size - loaded:
                    dev_of[il] = d
                    loaded = _f32(loaded + sizes[il])
                    il += 1
                break
            last = il
    for il in range(start, n_layer):
        out[il] = devices[dev_of[il]]
    if ngl > n_layer:
        out[n_layer] = devices[dev_of[n_layer]]
    return out


def default_devices(slots: Sequence[str], devices: Sequence[str]) -> list[int]:
    """model.default_layer_device per block: the index of the block's GPU; CPU blocks keep the last device."""
    index = {d: i for i, d in enumerate(devices)}
    return [index.get(s, len(devices) - 1) for s in slots[:-1]]


def tensor_split_for(counts: Sequence[int], n_layer: int, n_gpu_layers: int, sizes: Sequence[float],
                     max_compute: float) -> tuple[float, ...]:
    """-ts proportions under which split_slots gives GPU d exactly counts[d] consecutive GPU slots.

    Each boundary sits a quarter of the next slot past the bytes the devices before it hold, so float32
    rounding in ik (and our rounding of the printed values) cannot move a block."""
    n_dev = len(counts)
    start = max(n_layer - n_gpu_layers, 0)
    n_last = n_layer + (1 if n_gpu_layers > n_layer else 0)
    if sum(counts) != n_last - start:
        raise FlagError(f"internal error: layer counts {list(counts)} do not cover the {n_last - start} GPU slots")
    total = max_compute * n_dev + sum(sizes[start:n_last])
    bounds: list[float] = []
    acc, il = 0.0, start
    for d in range(n_dev - 1):
        acc += max_compute + sum(sizes[il:il + counts[d]])
        il += counts[d]
        # past the last GPU slot there is nothing to take: any margin keeps float32 rounding from dropping one
        nxt = sizes[il] if il < n_last else max(sizes[start:n_last], default=0.0)
        bounds.append(acc + 0.25 * nxt)
    bounds.append(total)
    margin = min((sizes[i] for i in range(start, n_last) if sizes[i] > 0), default=1.0) / (8 * n_dev)
    unit = float(1 << 20)
    while unit > 1 and unit > margin:
        unit /= 2
    props, prev = [], 0.0
    for b in bounds:
        props.append(max(round((b - prev) / unit), 0))
        prev += props[-1] * unit
    return tuple(float(x) for x in props)


def ncmoe_spread(n: int, default_device: Sequence[int], n_devices: int) -> list[int]:
    """Blocks whose experts ik's -ncmoe N sends to RAM with several GPUs in split mode layer.

    src/llama-load-tensors.cpp ~286-351 (8337e4cd): count the blocks per device (model.default_layer_device; blocks
    below -ngl keep the last device), give device d round(counts[d] / n_layer * N) (float32), trim or pad the
    total to N one at a time (the device furthest over / under its exact share), then walk the blocks from the
    last down, taking a block while its device still has some left. A block without experts still uses one up.
    """
    n_layer = len(default_device)
    counts = [0] * n_devices
    for d in default_device:
        counts[d] += 1
    f32 = np.float32
    share = [float(f32(f32(f32(c) / f32(n_layer)) * f32(n))) for c in counts]
    n_over = [int(math.floor(x + 0.5)) for x in share]        # roundf: halves away from zero
    want = [float(f32(f32(f32(c) * f32(n)) / f32(n_layer))) for c in counts]
    while sum(n_over) > n:
        cands = [(n_over[i] - 1 - want[i], -i) for i in range(n_devices) if n_over[i] > 0]
        if not cands:
            break
        n_over[-max(cands)[1]] -= 1
    while sum(n_over) < n:
        cands = [(n_over[i] + 1 - want[i], i) for i in range(n_devices) if n_over[i] < counts[i]]
        if not cands:
            break
        n_over[min(cands)[1]] += 1
    out: list[int] = []
    for il in range(n_layer - 1, -1, -1):
        d = default_device[il]
        if n_over[d] > 0:
            out.append(il)
            n_over[d] -= 1
    return sorted(out)
