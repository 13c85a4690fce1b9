"""Compute primitives of the forward pass, with a fast path per device kind and batch size.

Legend for shape comments: T tokens of the ubatch, D n_embd, H heads, Hkv KV heads, G = H / Hkv, N KV cells
attended (or output rows), E experts, A experts used per token, P = T * A (token, expert) pairs in (t, a) order,
F n_ff_exp, K a matmul's inner size.

Routed experts stay stacked [E, N, K] as ffn_*_exps (gate and up of one device packed [E, 2F, D]); every path
reads only the routed experts' weights, in place, never gathering them:
- CPU, T <= CPU_GEMV_MAX_T (decode): cpu_moe's OpenMP GEMV over the chosen experts' rows (one parallel pass per
  projection, where one F.linear per expert is bound by per-op overhead);
- CPU, larger T (or no C compiler): tokens grouped by expert, one F.linear per active expert on a view;
- CUDA, T <= GEMV_MAX_T: a Triton GEMV over the routed experts (ids read on the device: CUDA-graph safe);
- CUDA, larger T, bf16: torch._grouped_mm over the tokens sorted by expert (no host sync either).
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import cpu_moe
from .config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

log = logging.getLogger(__name__)

CPU_GEMV_MAX_T = 4      # cpu_moe's GEMV up to this many tokens (it reads the experts once per token)
GEMV_MAX_T = 8
GROUPED_MIN_T = 9       # = GEMV_MAX_T + 1: bf16 on CUDA never takes the (host-syncing) loop


# ---- norms, RoPE, attention -------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm times the weight, in float32; the result in `dtype` (default: x's)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype or x.dtype)


def rope_tables(n_pos: int, n_rot: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_pos, n_rot/2] float32: theta_i = p * base^(-2i/n_rot) (ggml_rope_ext without scaling)."""
    inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, kind: str) -> torch.Tensor:
    """x [T, h, d]; cos/sin [T, n_rot/2]. neox rotates (i, i + n_rot/2), norm rotates (2i, 2i + 1)."""
    xf = x.float()
    r, rest = xf[..., :n_rot], xf[..., n_rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    if kind == "neox":
        x1, x2 = r[..., : n_rot // 2], r[..., n_rot // 2:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    if rest.shape[-1]:
        out = torch.cat([out, rest], dim=-1)
    return out.to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, dk], k [Hkv, N, dk], v [Hkv, N, dv], mask [T, N] (True = attend) -> [T, H, dv].

    GQA without repeating the cache: the G query heads of a KV head become G*T query rows of that head.
    Sinks (gpt-oss): one extra logit per head in the softmax denominator (ggml_soft_max_add_sinks)."""
    T, H, dk = q.shape
    hkv, n = k.shape[0], k.shape[1]
    g = H // hkv
    if T == 1:      # decode: no copies (the one mask row broadcasts over the G query rows)
        qg, m = q.reshape(hkv, g, dk), mask.view(1, n)
    else:
        qg = q.view(T, hkv, g, dk).permute(1, 2, 0, 3).reshape(hkv, g * T, dk)   # [Hkv, G*T, dk]
        m = mask.unsqueeze(0).expand(g, T, n).reshape(g * T, n)                    # [G*T, N]
    if sinks is None:
        o = F.scaled_dot_product_attention(qg.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=m[None, None], scale=scale)[0]
    else:
        scores = torch.matmul(qg.float(), k.float().transpose(1, 2)) * scale        # [Hkv, G*T, N]
        scores = scores.masked_fill(~m.expand(g * T, n), float("-inf"))
        sink = sinks.float().view(hkv, g, 1, 1).expand(hkv, g, T, 1).reshape(hkv, g * T, 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :n]
        o = torch.matmul(p, v.float()).to(q.dtype)
    return o.view(hkv, g, T, -1).permute(2, 0, 1, 3).reshape(T, H, -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt ubatch at depth 0 (T queries over its own T keys, k [Hkv, T, dk]): flash attention with a causal
    mask and native GQA, no mask tensor. -> [T, H, dv]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       is_causal=True, scale=scale, enable_gqa=True)[0]     # [H, T, dv]
    return o.transpose(0, 1)


# ---- routing ---------------------------------------------------------------------------------------------------

def route(logits: torch.Tensor, n_used: int, gating: str, norm: bool, scale: float,
          probs_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (ids [T, A] int64, weights [T, A] float32), as llama-graph.cpp build_moe_ffn."""
    if gating == "softmax_weight":
        ids = torch.topk(logits, n_used, dim=-1).indices
        w = torch.softmax(logits.gather(-1, ids), dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1) if gating == "softmax" else torch.sigmoid(logits)
        select = probs if probs_bias is None else probs + probs_bias.float()
        ids = torch.topk(select, n_used, dim=-1).indices
        w = probs.gather(-1, ids)
    if norm:
        w = w / w.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
    if scale not in (0.0, 1.0):
        w = w * scale
    return ids, w


def activation(gu: torch.Tensor, n_ff: int, kind: str) -> torch.Tensor:
    """gu [..., 2F] (gate then up) -> [..., F] in gu's dtype, computed in float32."""
    g, u = gu[..., :n_ff].float(), gu[..., n_ff:].float()
    if kind == "swiglu_oai":    # ggml swiglu_oai: x = min(g, limit), y = clamp(u, -limit, limit)
        g = g.clamp(max=SWIGLU_OAI_LIMIT)
        u = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        out = g * torch.sigmoid(SWIGLU_OAI_ALPHA * g) * (u + 1.0)
    else:
        out = F.silu(g) * u
    return out.to(gu.dtype)


# ---- routed experts ---------------------------------------------------------------------------------------------
# Weights are stacked [E, N, K] as ffn_*_exps (gate and up of one device packed as [E, 2F, D]); x [T, K].

def _groups(ids: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, list[int]]:
    """(pair order sorted by expert, count per expert on the host)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_expert).tolist()
    return order, counts


def _loop_up(x: torch.Tensor, ids: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """One F.linear per active expert on a view of the stack (tokens grouped by expert): [P, N] float32."""
    T, A = ids.shape
    order, counts = _groups(ids, tables[0].shape[0])
    out = torch.empty(T * A, sum(t.shape[1] for t in tables), dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            pairs = order[start:start + c]
            xe = x.index_select(0, pairs // A)
            out[pairs] = torch.cat([F.linear(xe, t[e]) for t in tables], dim=-1).float()
            start += c
    return out


def _loop_down(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    T, A = ids.shape
    order, counts = _groups(ids, table.shape[0])
    out = torch.zeros(T, table.shape[1], dtype=torch.float32, device=h.device)
    wf = w.reshape(-1)
    start = 0
    for e, c in enumerate(counts):
        if c:
            pairs = order[start:start + c]
            y = F.linear(h.index_select(0, pairs), table[e]).float() * wf[pairs, None]
            out.index_add_(0, pairs // A, y)
            start += c
    return out


def _grouped_offsets(ids: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair order sorted by expert, end offset of each expert's group) on the device. The sort key is the
    narrowest integer type that holds an expert id: a radix sort makes one pass per key byte."""
    flat = ids.reshape(-1)
    key = flat.to(torch.uint8 if n_expert <= 256 else torch.int16 if n_expert <= 32768 else torch.int32)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(n_expert, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    return order, torch.cumsum(counts, 0, dtype=torch.int32)


def _grouped_up(x: torch.Tensor, ids: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """torch._grouped_mm over the pairs sorted by expert (offsets on the device: no host sync)."""
    T, A = ids.shape
    order, offs = _grouped_offsets(ids, tables[0].shape[0])
    xs = x.index_select(0, order // A)                                                          # [P, K]
    ys = torch.cat([torch._grouped_mm(xs, t.transpose(-2, -1), offs=offs) for t in tables], dim=-1)   # [P, N]
    out = torch.empty_like(ys, dtype=torch.float32)
    out[order] = ys.float()
    return out


def _grouped_down(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    T, A = ids.shape
    order, offs = _grouped_offsets(ids, table.shape[0])
    ys = torch._grouped_mm(h.index_select(0, order), table.transpose(-2, -1), offs=offs).float()      # [P, D]
    ys = ys * w.reshape(-1)[order, None]
    return torch.zeros(T, table.shape[1], dtype=torch.float32, device=h.device).index_add_(0, order // A, ys)


def grouped_mm_nt(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows of a (sorted by expert, group e ending at offs[e]) times w[e].T, w stacked [E, N, K]."""
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


def unsort_combine(y: torch.Tensor, inverse: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [P, D] in expert order -> [T, D] float32: sum over a of w[t, a] * y[inverse[t * A + a]] (ggml scales
    mul_mat_id's float32 rows by the weights and sums them; one fused kernel when compiled)."""
    T, A = w.shape
    return (y.index_select(0, inverse).view(T, A, -1).float() * w.unsqueeze(-1)).sum(1)


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, tables: list[torch.Tensor],
                    down: torch.Tensor, n_ff: int, act: str, mm: Callable = grouped_mm_nt,
                    act_fn: Callable | None = None, combine_fn: Callable = unsort_combine) -> torch.Tensor:
    """A prompt ubatch's routed experts on CUDA (bf16, no biases): the (token, expert) pairs sorted by expert
    once, then up, activation, down, and the rows weighted and summed back per token in float32. -> [T, D]
    float32. `mm` is the grouped product (a loop stands in for it in CPU tests); act_fn(gu) and combine_fn are
    compiled fusions where available."""
    T, A = ids.shape
    order, offs = _grouped_offsets(ids, tables[0].shape[0])
    xs = x.index_select(0, order // A)                                                           # [P, D]
    gu = mm(xs, tables[0], offs) if len(tables) == 1 else torch.cat([mm(xs, t, offs) for t in tables], -1)
    h = act_fn(gu) if act_fn is not None else activation(gu, n_ff, act)                         # [P, F]
    y = mm(h, down, offs)                                                                        # [P, D]
    inverse = torch.empty(order.numel(), dtype=torch.int32, device=order.device)
    inverse[order] = torch.arange(order.numel(), dtype=torch.int32, device=order.device)
    return combine_fn(y, inverse, w)


def cuda_syncs(T: int, dtype: torch.dtype) -> bool:
    """Whether the CUDA expert path for T tokens reads expert counts on the host (the per-expert loop):
    such an op cannot be captured in a CUDA graph."""
    return not (T <= GEMV_MAX_T and triton_ok()) and not _grouped(T, dtype)


def grouped_ok(device: torch.device, T: int, dtype: torch.dtype) -> bool:
    return (device.type == "cuda" and _grouped(T, dtype) and ("grouped_mm", device.index or 0)
            not in CAPABILITIES.failed)


class _Capability:
    """Whether an optional fast path worked on a device (it is tried once, and dropped after a failure), and
    every fast path dropped in this process, in order: TorchEngine reports the ones a measurement ran without in
    Measurement.raw["fallbacks"] (a slower path is a fact about the number, not an error)."""

    def __init__(self) -> None:
        self.failed: set[tuple[str, int]] = set()
        self.events: list[str] = []

    def fell_back(self, what: str, error: BaseException) -> None:
        note = f"{what}: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
        self.events.append(note)
        log.warning("fast path dropped, running its fallback: %s", note)

    def dropped(self) -> list[str]:
        """The fast paths dropped for good (every later run uses the fallback)."""
        return [f"{name} on device {index}" for name, index in sorted(self.failed)]

    def run(self, name: str, device: torch.device, fast: Callable, fallback: Callable, *args):
        key = (name, device.index or 0)
        if key not in self.failed:
            try:
                return fast(*args)
            except RuntimeError as e:
                self.failed.add(key)
                self.fell_back(f"{name} on device {key[1]}", e)
        return fallback(*args)


CAPABILITIES = _Capability()


def _cuda_small(T: int) -> bool:
    return T <= GEMV_MAX_T and triton_ok()


def _grouped(T: int, dtype: torch.dtype) -> bool:
    return T >= GROUPED_MIN_T and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def experts_up(x: torch.Tensor, ids: torch.Tensor, tables: list[torch.Tensor], biases: list[torch.Tensor | None],
               threads: int = 1) -> torch.Tensor:
    """x [T, K] -> [P, N] float32 (N = the tables' rows, gate then up): x[t] @ W[ids[t, a]].T + b."""
    T = x.shape[0]
    if x.device.type == "meta":     # a dry run (TorchEngine.predict_memory): the result's shape, as every path gives
        return torch.empty(ids.numel(), sum(t.shape[1] for t in tables), dtype=torch.float32, device=x.device)
    if x.device.type == "cuda":
        if _cuda_small(T):
            y = torch.cat([moe_gemv(x, ids, t, per_pair=False) for t in tables], dim=-1)
        elif _grouped(T, x.dtype):
            y = CAPABILITIES.run("grouped_mm", x.device, _grouped_up, _loop_up, x, ids, tables)
        else:
            y = _loop_up(x, ids, tables)
    elif T <= CPU_GEMV_MAX_T and cpu_moe.available(tables[0].dtype):
        y = torch.cat([cpu_moe.moe_up(x, ids, t, threads) for t in tables], dim=-1)
    else:
        y = _loop_up(x, ids, tables)
    if any(b is not None for b in biases):
        flat = ids.reshape(-1)
        y = y + torch.cat([b.index_select(0, flat).float() for b in biases if b is not None], dim=-1)
    return y


def experts_down(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, table: torch.Tensor,
                 bias: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
    """h [P, F] -> [T, D] float32: sum over a of w[t, a] * (h[p] @ Wd[ids[t, a]].T + b)."""
    T = ids.shape[0]
    if h.device.type == "meta":     # a dry run: the result's shape
        return torch.empty(T, table.shape[1], dtype=torch.float32, device=h.device)
    if h.device.type == "cuda":
        if _cuda_small(T):
            out = moe_down_combine(h, ids, w, table)
        elif _grouped(T, h.dtype):
            out = CAPABILITIES.run("grouped_mm", h.device, _grouped_down, _loop_down, h, ids, w, table)
        else:
            out = _loop_down(h, ids, w, table)
    elif T <= CPU_GEMV_MAX_T and cpu_moe.available(table.dtype):
        out = cpu_moe.moe_down(h, ids, w, table, threads)
    else:
        out = _loop_down(h, ids, w, table)
    if bias is not None:
        out = out + (bias.index_select(0, ids.reshape(-1)).float().view(T, -1, bias.shape[-1])
                     * w.unsqueeze(-1)).sum(1)
    return out


# ---- Triton GEMV over routed experts (CUDA) -------------------------------------------------------------------
# Decode reads each routed expert once per token: these kernels are bandwidth-bound, so their tile shape is
# autotuned once per (N, K, dtype) on the first (eager, pre-capture) call.

def _gemv_configs():
    import triton
    if os.environ.get("TRITON_INTERPRET") == "1":      # the CPU interpreter (tests of the kernels' math)
        return [triton.Config({"BN": 8, "BK": 256})]
    return [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bn in (4, 8, 16) for bk in (256, 512) for w in (4, 8) for s in (2, 3)]


def on_device(t: torch.Tensor) -> torch.cuda.device:
    """Triton launches on the current device, not its tensors' (cuda:1's under cuda:0: an illegal memory access)."""
    return torch.cuda.device(t.device)


@lru_cache(maxsize=1)
def triton_ok() -> bool:
    try:
        import triton  # noqa: F401
        return _moe_gemv_kernel() is not None
    except Exception:
        return False


@lru_cache(maxsize=1)
def _moe_gemv_kernel():
    import triton
    import triton.language as tl

    @triton.autotune(configs=_gemv_configs(), key=["N", "K", "A", "PER_PAIR", "NO_IDS"])
    @triton.jit
    def moe_gemv_kernel(x_ptr, w_ptr, ids_ptr, y_ptr, N, K, stride_x, stride_we, stride_wn,
               A: tl.constexpr, PER_PAIR: tl.constexpr, NO_IDS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # y[p, n] = dot(w[ids[p], n, :], x[row(p), :]) for the BN rows n of this program (w[0] when NO_IDS)
        p = tl.program_id(0)
        nb = tl.program_id(1)
        if NO_IDS:
            e = 0
        else:
            e = tl.load(ids_ptr + p).to(tl.int64)
        row = p if PER_PAIR else p // A
        on = nb * BN + tl.arange(0, BN)
        nm = on < N
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ok = k0 + tl.arange(0, BK)
            km = ok < K
            xv = tl.load(x_ptr + row * stride_x + ok, mask=km, other=0.0).to(tl.float32)
            wt = tl.load(w_ptr + e * stride_we + on[:, None] * stride_wn + ok[None, :],
                         mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc += wt * xv[None, :]
        tl.store(y_ptr + p * N + on, tl.sum(acc, axis=1), mask=nm)

    return moe_gemv_kernel


@lru_cache(maxsize=1)
def _moe_down_kernel():
    import triton
    import triton.language as tl

    @triton.autotune(configs=_gemv_configs(), key=["N", "K", "A"])
    @triton.jit
    def moe_down_kernel(h_ptr, w_ptr, ids_ptr, wt_ptr, y_ptr, N, K, stride_h, stride_we, stride_wn,
               A: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # y[t, n] = sum_a wt[t, a] * dot(w[ids[t, a], n, :], h[t * A + a, :]): down and the weighted sum in one
        t = tl.program_id(0)
        nb = tl.program_id(1)
        on = nb * BN + tl.arange(0, BN)
        nm = on < N
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for a in tl.static_range(A):
            p = t * A + a
            e = tl.load(ids_ptr + p).to(tl.int64)
            s = tl.load(wt_ptr + p)
            for k0 in range(0, K, BK):
                ok = k0 + tl.arange(0, BK)
                km = ok < K
                hv = tl.load(h_ptr + p * stride_h + ok, mask=km, other=0.0).to(tl.float32) * s
                wt = tl.load(w_ptr + e * stride_we + on[:, None] * stride_wn + ok[None, :],
                             mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
                acc += wt * hv[None, :]
        tl.store(y_ptr + t * N + on, tl.sum(acc, axis=1), mask=nm)

    return moe_down_kernel


def moe_gemv(x: torch.Tensor, ids: torch.Tensor | None, table: torch.Tensor, per_pair: bool, A: int = 1
             ) -> torch.Tensor:
    """[P, N] float32: row(p) of x times table[ids[p]].T, table [E, N, K] with unit stride along K; one program
    per (pair, BN rows), each streaming its rows once (graph-capturable: the ids stay on the device).
    ids None: a plain GEMV with table[0] for every row of x (P = rows of x)."""
    import triton
    if ids is not None:
        T, A = ids.shape
        P = T * A
    else:
        P = x.shape[0]
    _, N, K = table.shape
    x = x.contiguous()
    y = torch.empty(P, N, dtype=torch.float32, device=x.device)
    with on_device(x):
        _moe_gemv_kernel()[lambda meta: (P, triton.cdiv(N, meta["BN"]))](
            x, table, ids.reshape(-1).contiguous() if ids is not None else x, y, N, K, x.stride(0),
            table.stride(0), table.stride(1), A=A, PER_PAIR=per_pair or ids is None, NO_IDS=ids is None)
    return y


def moe_down_combine(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[T, D] float32 = sum over a of w[t, a] * h[t*A + a] @ table[ids[t, a]].T (experts_down's GEMV path)."""
    import triton
    T, A = ids.shape
    _, N, K = table.shape
    h = h.contiguous()
    y = torch.empty(T, N, dtype=torch.float32, device=h.device)
    with on_device(h):
        _moe_down_kernel()[lambda meta: (T, triton.cdiv(N, meta["BN"]))](
            h, table, ids.reshape(-1).contiguous(), w.reshape(-1).float().contiguous(), y, N, K, h.stride(0),
            table.stride(0), table.stride(1), A=A)
    return y


# ---- attention of one decode token (CUDA): split over the cache, the KV write in the first split ---------------
# Flash-decoding: one program per (query head, block of DECODE_BLOCK cells) computes a partial softmax (max,
# sum, weighted V); a second kernel merges a head's partials. Per-program work stays one block at any context
# length (one program looping over the whole cache ran ~170 us per layer at 2.3k cells on the H100).

DECODE_BLOCK = 64
_NEG = -1.0e30      # "minus infinity" that keeps exp(a - b) finite when a whole block is masked


@lru_cache(maxsize=1)
def _decode_attention_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, pos_ptr, m_ptr, l_ptr, a_ptr, scale, S,
                                s_q, s_kn, s_vn, s_kch, s_kcn, s_vch, s_vcn,
                                G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                                BDV: tl.constexpr, BN: tl.constexpr, NEG: tl.constexpr):
        # query head h over cells [b*BN, b*BN + BN) that precede pos; block 0 also takes the new token (k/v from
        # registers) and, for the first query head of a KV head, stores it into cell pos (no other program reads
        # cell pos, so there is no race)
        h = tl.program_id(0)
        b = tl.program_id(1)
        kvh = h // G
        pos = tl.load(pos_ptr)
        dk = tl.arange(0, BDK)
        dv = tl.arange(0, BDV)
        mk = dk < DK
        mv = dv < DV
        q = tl.load(q_ptr + h * s_q + dk, mask=mk, other=0.0).to(tl.float32)
        first = b == 0
        kn = tl.load(kn_ptr + kvh * s_kn + dk, mask=mk, other=0.0).to(kc_ptr.dtype.element_ty)
        vn = tl.load(vn_ptr + kvh * s_vn + dv, mask=mv, other=0.0).to(vc_ptr.dtype.element_ty)
        write = first & (h % G == 0)
        tl.store(kc_ptr + kvh * s_kch + pos * s_kcn + dk, kn, mask=mk & write)
        tl.store(vc_ptr + kvh * s_vch + pos * s_vcn + dv, vn, mask=mv & write)
        m = tl.where(first, tl.sum(q * kn.to(tl.float32), axis=0) * scale, NEG)
        l = tl.where(first, 1.0, 0.0)
        acc = tl.where(first, vn.to(tl.float32), 0.0)
        oj = b * BN + tl.arange(0, BN)
        jm = oj < pos
        k = tl.load(kc_ptr + kvh * s_kch + oj[:, None] * s_kcn + dk[None, :], mask=jm[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        sc = tl.where(jm, tl.sum(k * q[None, :], axis=1) * scale, NEG)
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(jm, tl.exp(sc - m_new), 0.0)
        v = tl.load(vc_ptr + kvh * s_vch + oj[:, None] * s_vcn + dv[None, :], mask=jm[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        tl.store(m_ptr + h * S + b, m_new)
        tl.store(l_ptr + h * S + b, l)
        tl.store(a_ptr + (h * S + b) * BDV + dv, acc)

    @triton.jit
    def decode_merge_kernel(m_ptr, l_ptr, a_ptr, o_ptr, S, s_o, DV: tl.constexpr, BDV: tl.constexpr,
                            BS: tl.constexpr, NEG: tl.constexpr):
        # o[h] = sum_b e^(m_b - M) acc_b / sum_b e^(m_b - M) l_b over the head's S partials, BS at a time
        h = tl.program_id(0)
        dv = tl.arange(0, BDV)
        mx = tl.max(tl.full((BS,), NEG, tl.float32), axis=0)      # fp32 scalars: loop-carried types stay fixed
        tot_l = tl.sum(tl.zeros((BS,), dtype=tl.float32), axis=0)
        tot = tl.zeros((BDV,), dtype=tl.float32)
        for s0 in range(0, S, BS):
            os_ = s0 + tl.arange(0, BS)
            ms = os_ < S
            mb = tl.load(m_ptr + h * S + os_, mask=ms, other=NEG)
            lb = tl.load(l_ptr + h * S + os_, mask=ms, other=0.0)
            ab = tl.load(a_ptr + (h * S + os_[:, None]) * BDV + dv[None, :], mask=ms[:, None], other=0.0)
            m_new = tl.maximum(mx, tl.max(mb, axis=0))
            alpha = tl.exp(mx - m_new)
            w = tl.where(ms, tl.exp(mb - m_new), 0.0)
            tot = tot * alpha + tl.sum(w[:, None] * ab, axis=0)
            tot_l = tot_l * alpha + tl.sum(w * lb, axis=0)
            mx = m_new
        tl.store(o_ptr + h * s_o + dv, (tot / tot_l).to(o_ptr.dtype.element_ty), mask=dv < DV)

    return decode_attention_kernel, decode_merge_kernel


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, pos: torch.Tensor, scale: float, n_kv: int) -> torch.Tensor:
    """One token at position pos[0] < n_kv (on the device), q [H, Dk], k [Hkv, Dk], v [Hkv, Dv]: writes k/v into
    cell pos of cache_k/cache_v [Hkv, cells, D] and attends to cells 0..pos (llama.cpp's causal mask) -> [H, Dv]."""
    import triton
    H, Dk = q.shape
    Hkv, Dv = v.shape
    S = triton.cdiv(n_kv, DECODE_BLOCK)
    bdk, bdv = triton.next_power_of_2(Dk), triton.next_power_of_2(Dv)
    m = torch.empty(H, S, dtype=torch.float32, device=q.device)
    ll = torch.empty(H, S, dtype=torch.float32, device=q.device)
    acc = torch.empty(H, S, bdv, dtype=torch.float32, device=q.device)
    o = torch.empty(H, Dv, dtype=q.dtype, device=q.device)
    partial, merge = _decode_attention_kernels()
    with on_device(q):
        partial[(H, S)](q, k, v, cache_k, cache_v, pos, m, ll, acc, float(scale), S, q.stride(0), k.stride(0),
                        v.stride(0), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1),
                        G=H // Hkv, DK=Dk, DV=Dv, BDK=bdk, BDV=bdv, BN=DECODE_BLOCK, NEG=_NEG, num_warps=4)
        merge[(H,)](m, ll, acc, o, S, o.stride(0), DV=Dv, BDV=bdv, BS=32, NEG=_NEG, num_warps=4)
    return o


# ---- routing for CUDA decode: the router GEMV and the top-k selection as two Triton kernels -------------------

@lru_cache(maxsize=1)
def _select_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def select_kernel(l_ptr, lb_ptr, sb_ptr, ids_ptr, w_ptr, E, scale,
               HAS_LB: tl.constexpr, HAS_SB: tl.constexpr, GATING: tl.constexpr, NORM: tl.constexpr,
               SCALE: tl.constexpr, A: tl.constexpr, BE: tl.constexpr):
        # one token: logits (+ bias) -> probs (softmax / sigmoid / raw), top-A by selection score
        # (+ exp_probs_b), the chosen probs as weights (softmax over the chosen logits for GATING 2)
        t = tl.program_id(0)
        oe = tl.arange(0, BE)
        m = oe < E
        lg = tl.load(l_ptr + t * E + oe, mask=m, other=float("-inf"))
        if HAS_LB:
            lg += tl.load(lb_ptr + oe, mask=m, other=0.0)
        if GATING == 0:
            ex = tl.exp(lg - tl.max(lg, axis=0))
            p = ex / tl.sum(tl.where(m, ex, 0.0), axis=0)
        elif GATING == 1:
            p = 1.0 / (1.0 + tl.exp(-lg))
        else:
            p = lg
        sel = p
        if HAS_SB:
            sel += tl.load(sb_ptr + oe, mask=m, other=0.0)
        sel = tl.where(m, sel, float("-inf"))
        total = 0.0
        first = 0.0
        for a in tl.static_range(A):
            best = tl.max(sel, axis=0)
            idx = tl.min(tl.where(sel == best, oe, BE), axis=0)
            v = tl.sum(tl.where(oe == idx, p, 0.0), axis=0)
            if GATING == 2:
                if a == 0:
                    first = v
                v = tl.exp(v - first)
            total += v
            tl.store(ids_ptr + t * A + a, idx.to(tl.int64))
            tl.store(w_ptr + t * A + a, v)
            sel = tl.where(oe == idx, float("-inf"), sel)
        tl.debug_barrier()
        oa = tl.arange(0, A)
        wv = tl.load(w_ptr + t * A + oa)
        if GATING == 2 or NORM:
            wv = wv / tl.maximum(total, 6.103515625e-5)
        if SCALE:
            wv = wv * scale
        tl.debug_barrier()
        tl.store(w_ptr + t * A + oa, wv)

    return select_kernel


def route_fast(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n_used: int, gating: str, norm: bool,
               scale: float, probs_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """route() for decode on CUDA in two kernels (the GEMV reads the float32 router in place, bf16 x converted
    in the kernel): ids [T, A] int64, weights [T, A] float32. n_used must be a power of two."""
    logits = moe_gemv(x, None, w.unsqueeze(0), per_pair=True)                                # [T, E] float32
    return select(logits, bias, n_used, gating, norm, scale, probs_bias)


def select(logits: torch.Tensor, bias: torch.Tensor | None, n_used: int, gating: str, norm: bool, scale: float,
           probs_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """route() from float32 logits [T, E] (+ bias) in one kernel, one program per token (on a 2048-token prompt
    ubatch it replaces softmax, top-k, gather and the normalisation). n_used must be a power of two."""
    import triton
    T, E = logits.shape
    logits = logits.contiguous()
    ids = torch.empty(T, n_used, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, n_used, dtype=torch.float32, device=logits.device)
    with on_device(logits):
        _select_kernel()[(T,)](logits, bias if bias is not None else logits, probs_bias if probs_bias is not None
                               else logits, ids, weights, E, float(scale),
                               HAS_LB=bias is not None, HAS_SB=probs_bias is not None,
                               GATING={"softmax": 0, "sigmoid": 1, "softmax_weight": 2}[gating], NORM=norm,
                               SCALE=scale not in (0.0, 1.0), A=n_used, BE=triton.next_power_of_2(E))
    return ids, weights


# ---- Q/K RMSNorm and RoPE (CUDA) ---------------------------------------------------------------------------------
# One program per (token, 8 heads) reads its rows once (and their RoPE partners from cache): 17 us per layer for
# a 2048-token ubatch of 32 + 4 heads of 128 on the H100, where the compiled torch version took 38 (one head per
# program took 47: too little work per program). Rounding as rms_norm then rope: the normalised row is rounded to
# the compute dtype before the rotation.

@lru_cache(maxsize=1)
def _qk_rope_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def qk_rope_kernel(x_ptr, nw_ptr, pos_ptr, cos_ptr, sin_ptr, o_ptr, s_t, s_h, n_heads, eps,
                       DK: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, NROT: tl.constexpr,
                       NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
        # rows [BH heads, BD]: the heads hb*BH.. of token t
        t = tl.program_id(0)
        hs = tl.program_id(1) * BH + tl.arange(0, BH)
        d = tl.arange(0, BD)
        hm = hs < n_heads
        dm = d < DK
        half: tl.constexpr = NROT // 2
        if NEOX:
            partner = tl.where(d < half, d + half, d - half)
            j = tl.where(d < half, d, d - half)
            sign = tl.where(d < half, -1.0, 1.0)
        else:
            partner = d ^ 1
            j = d // 2
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        rot = d < NROT
        m = hm[:, None] & dm[None, :]
        mr = hm[:, None] & (rot & dm)[None, :]
        rows = x_ptr + t.to(tl.int64) * s_t + hs[:, None] * s_h
        x = tl.load(rows + d[None, :], mask=m, other=0.0).to(tl.float32)
        xp = tl.load(rows + partner[None, :], mask=mr, other=0.0).to(tl.float32)
        if HAS_NORM:
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DK + eps)
            nw = tl.load(nw_ptr + d, mask=dm, other=0.0)
            nwp = tl.load(nw_ptr + partner, mask=rot & dm, other=0.0)
            x = (x * r[:, None] * nw[None, :]).to(o_ptr.dtype.element_ty).to(tl.float32)
            xp = (xp * r[:, None] * nwp[None, :]).to(o_ptr.dtype.element_ty).to(tl.float32)
        p = tl.load(pos_ptr + t)
        c = tl.load(cos_ptr + p * half + j, mask=rot, other=1.0)
        sn = tl.load(sin_ptr + p * half + j, mask=rot, other=0.0)
        out = tl.where(rot[None, :], x * c[None, :] + sign[None, :] * xp * sn[None, :], x)
        dst = o_ptr + (t.to(tl.int64) * n_heads + hs[:, None]) * DK + d[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=m)

    return qk_rope_kernel


def qk_rope(x: torch.Tensor, norm_w: torch.Tensor | None, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            eps: float, n_rot: int, kind: str) -> torch.Tensor:
    """rope(rms_norm(x, norm_w, eps) if norm_w is given else x) in one kernel: x [T, h, d] (unit stride along d),
    pos [T] on the device, cos/sin [n_pos, n_rot/2] float32 -> [T, h, d] contiguous in x's dtype."""
    import triton
    T, nh, Dk = x.shape
    o = torch.empty(T, nh, Dk, dtype=x.dtype, device=x.device)
    nw = norm_w.float().contiguous() if norm_w is not None else cos
    bh = min(8, triton.next_power_of_2(nh))
    with on_device(x):
        _qk_rope_kernel()[(T, triton.cdiv(nh, bh))](
            x, nw, pos, cos.contiguous(), sin.contiguous(), o, x.stride(0), x.stride(1), nh, float(eps), DK=Dk,
            BD=triton.next_power_of_2(Dk), BH=bh, NROT=n_rot, NEOX=kind == "neox", HAS_NORM=norm_w is not None,
            num_warps=4)
    return o


# ---- the weighted sum of a prompt ubatch's expert rows (CUDA) ----------------------------------------------------
# The down projection leaves its rows in expert order; each token sums its A rows, read through the inverse of
# the sort. One program per (token, BD columns): on the H100 (T 2048, A 8, D 2048) 27.5 us per layer in the
# engine's profile, where the compiled torch version (index_select, multiply, sum) took 87.5.

def _combine_configs():
    import triton
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BD": 16})]
    return [triton.Config({"BD": bd}, num_warps=w) for bd, w in ((512, 1), (1024, 1), (1024, 4), (2048, 8))]


@lru_cache(maxsize=1)
def _combine_kernel():
    import triton
    import triton.language as tl

    @triton.autotune(configs=_combine_configs(), key=["D", "A"])
    @triton.jit
    def combine_kernel(y_ptr, inv_ptr, w_ptr, o_ptr, D, stride_y, A: tl.constexpr, BA: tl.constexpr,
                       BD: tl.constexpr):
        # o[t, d] = sum_a w[t, a] * y[inv[t * A + a], d] in float32
        t = tl.program_id(0)
        od = tl.program_id(1) * BD + tl.arange(0, BD)
        dm = od < D
        oa = tl.arange(0, BA)
        am = oa < A
        src = tl.load(inv_ptr + t * A + oa, mask=am, other=0).to(tl.int64)
        wt = tl.load(w_ptr + t * A + oa, mask=am, other=0.0)
        v = tl.load(y_ptr + src[:, None] * stride_y + od[None, :], mask=am[:, None] & dm[None, :], other=0.0)
        tl.store(o_ptr + t.to(tl.int64) * D + od, tl.sum(v.to(tl.float32) * wt[:, None], axis=0), mask=dm)

    return combine_kernel


def combine(y: torch.Tensor, inverse: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """unsort_combine as one Triton kernel (y [P, D] in expert order, inverse [P] int32) -> [T, D] float32."""
    import triton
    T, A = w.shape
    D = y.shape[1]
    o = torch.empty(T, D, dtype=torch.float32, device=y.device)
    with on_device(y):
        _combine_kernel()[lambda meta: (T, triton.cdiv(D, meta["BD"]))](
            y, inverse, w.float().contiguous(), o, D, y.stride(0), A=A, BA=triton.next_power_of_2(A))
    return o


# ---- compiled helpers for CUDA decode -------------------------------------------------------------------------

def maybe_compiled(fn: Callable, enabled: bool) -> Callable:
    """torch.compile(fn) (one fused kernel instead of several small ones inside a decode CUDA graph), falling
    back to fn if compilation fails on first use."""
    if not enabled:
        return fn
    import torch._dynamo
    cfg = torch._dynamo.config      # every layer shares one compiled graph per helper; shapes and dtypes vary
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    compiled = torch.compile(fn, dynamic=None, fullgraph=False)   # static first, symbolic T after a second shape
    state = {"fn": compiled}

    def call(*args, **kw):
        try:
            return state["fn"](*args, **kw)
        except Exception as e:
            if state["fn"] is fn:
                raise
            state["fn"] = fn
            CAPABILITIES.fell_back(f"torch.compile of {getattr(fn, '__name__', 'a helper')}", e)
            return fn(*args, **kw)
    return call


def causal_mask(pos: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[T, n_kv]: cell j (holding position j) is visible to a query at pos if j <= pos."""
    return torch.arange(n_kv, device=pos.device)[None, :] <= pos[:, None]


def window_mask(pos: torch.Tensor, cell_pos: torch.Tensor, n_swa: int) -> torch.Tensor:
    """[T, cells] for a ring of cells holding positions cell_pos (-1 empty): standard sliding window
    (llama-hparams.cpp is_masked_swa: masked when pos - p >= n_swa)."""
    cp = cell_pos[None, :]
    q = pos[:, None]
    return (cp >= 0) & (cp <= q) & (q - cp < n_swa)


def ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


