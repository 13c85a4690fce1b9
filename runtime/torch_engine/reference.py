"""A plain implementation of the four architectures, for tests: no placement, no KV cache, no packing, no fast
paths; float64 arithmetic; loops over tokens, heads and experts; MLA in its original (not absorbed) form.

    weights = reference_weights(inv, source, dtype)     # every tensor in its torch shape, as the engine stores it
    logits = reference_logits(cfg, weights, tokens, round_to=torch.bfloat16)   # [T, n_vocab] float64

`round_to` rounds activations where a compute-dtype engine holds them (matmul outputs, norm outputs, the
expert activation); the residual stream and router logits stay exact, as in the engine. Without it a bf16
engine and an exact reference pick different experts for tokens whose router scores nearly tie, and the
comparison measures those flips rather than the arithmetic. `margins` and `routes` report the routing.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from planner.model import ModelInventory

from .config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, ModelConfig
from .placement import is_float32_tensor
from .weights import WeightSource, torch_shape


def reference_weights(inv: ModelInventory, source: WeightSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The values the engine computes with (its dtype, float32 for routers and norms), as float64."""
    out = {}
    for t in inv.allocated():
        w = torch.empty(torch_shape(t.shape), dtype=torch.float32 if is_float32_tensor(t.name) else dtype)
        source.fill(t.name, w)
        out[t.name] = w.double()
    for layer in range(inv.hparams.n_layer):
        b = source.router_bias(layer)
        if b is not None:
            out[f"blk.{layer}.router_bias"] = b.double()
    return out


def reference_logits(cfg: ModelConfig, W: dict[str, torch.Tensor], tokens: Sequence[int],
                     round_to: torch.dtype | None = None, margins: list[float] | None = None,
                     routes: dict[int, set[int]] | None = None) -> torch.Tensor:
    """Logits [T, n_vocab] of tokens at positions 0..T-1. `margins`, if a list, receives for every routing
    decision the gap between the last chosen and the first unchosen expert's selection score, in router-logit
    units (a gap near 0 is a near-tie that any rounding difference may flip); `routes`, if a dict, receives
    per MoE layer the set of experts any token was routed to."""
    return _Reference(cfg, W, round_to, margins, routes).forward(list(tokens))


def _act(g: torch.Tensor, u: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "swiglu_oai":
        g = torch.clamp(g, max=SWIGLU_OAI_LIMIT)
        u = torch.clamp(u, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return g / (1 + torch.exp(-SWIGLU_OAI_ALPHA * g)) * (u + 1)
    return g / (1 + torch.exp(-g)) * u


class _Reference:
    def __init__(self, cfg: ModelConfig, W: dict[str, torch.Tensor], round_to: torch.dtype | None,
                 margins: list[float] | None, routes: dict[int, set[int]] | None) -> None:
        self.cfg, self.W, self.round_to, self.margins, self.routes = cfg, W, round_to, margins, routes

    def r(self, x: torch.Tensor) -> torch.Tensor:
        """x as the engine holds it in its compute dtype."""
        return x if self.round_to is None else x.to(self.round_to).double()

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.r(x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.cfg.rms_eps) * w)

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.W[name + ".weight"].T
        if name + ".bias" in self.W:
            y = y + self.W[name + ".bias"]
        return self.r(y)

    def rope(self, x: torch.Tensor, n_rot: int) -> torch.Tensor:
        """x [T, h, d]: token t rotated at position t, pairs (i, i + n_rot/2) (neox) or (2i, 2i + 1) (norm)."""
        cfg = self.cfg
        out = x.clone()
        for t in range(x.shape[0]):
            for i in range(n_rot // 2):
                theta = t * cfg.rope_base ** (-2.0 * i / n_rot)
                c, s = math.cos(theta), math.sin(theta)
                a, b = (i, i + n_rot // 2) if cfg.rope_type == "neox" else (2 * i, 2 * i + 1)
                out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
                out[t, :, b] = x[t, :, a] * s + x[t, :, b] * c
        return self.r(out)

    def visible(self, il: int, t: int, s: int) -> bool:
        cfg = self.cfg
        return s <= t and not (cfg.swa_layers[il] and cfg.n_swa and t - s >= cfg.n_swa)

    @staticmethod
    def attend(scores: list[float], values: torch.Tensor, sink: float | None) -> torch.Tensor:
        """softmax over scores (-inf for masked keys, plus a sink logit) times values [S, dv]."""
        s = torch.tensor(scores + ([sink] if sink is not None else []), dtype=torch.float64)
        return torch.softmax(s, dim=0)[: values.shape[0]] @ values

    def attention(self, il: int, h: torch.Tensor) -> torch.Tensor:
        cfg, W, p = self.cfg, self.W, f"blk.{il}."
        T = h.shape[0]
        H, Hkv, Dk, Dv = cfg.n_head, cfg.n_head_kv[il], cfg.head_dim_k, cfg.head_dim_v
        q = self.linear(p + "attn_q", h).view(T, H, Dk)
        k = self.linear(p + "attn_k", h).view(T, Hkv, Dk)
        v = self.linear(p + "attn_v", h).view(T, Hkv, Dv)
        if cfg.qk_norm:
            q, k = self.rms(q, W[p + "attn_q_norm.weight"]), self.rms(k, W[p + "attn_k_norm.weight"])
        q, k = self.rope(q, cfg.n_rot), self.rope(k, cfg.n_rot)
        o = torch.zeros(T, H, Dv, dtype=torch.float64)
        for hd in range(H):
            kv = hd // (H // Hkv)
            sink = float(W[p + "attn_sinks.weight"][hd]) if cfg.sinks else None
            for t in range(T):
                scores = [float(q[t, hd] @ k[s, kv]) * cfg.kq_scale if self.visible(il, t, s) else -math.inf
                          for s in range(T)]
                o[t, hd] = self.attend(scores, v[:, kv], sink)
        return self.r(o.reshape(T, H * Dv))

    def mla(self, il: int, h: torch.Tensor) -> torch.Tensor:
        """MLA as in the DeepSeek-V2 paper: per-head keys and values decompressed from the latent kv_c."""
        cfg, W, p = self.cfg, self.W, f"blk.{il}."
        T = h.shape[0]
        H, L, R, Dk, Dv = cfg.n_head, cfg.kv_lora_rank, cfg.n_rot, cfg.head_dim_k_mla, cfg.head_dim_v_mla
        nope = Dk - R
        if cfg.q_lora_rank:
            qa = self.rms(self.r(h @ W[p + "attn_q_a.weight"].T), W[p + "attn_q_a_norm.weight"])
            q = self.r(qa @ W[p + "attn_q_b.weight"].T)
        else:
            q = self.r(h @ W[p + "attn_q.weight"].T)
        q = q.view(T, H, Dk)
        q_pe = self.rope(q[..., nope:].contiguous(), R)
        kv = self.r(h @ W[p + "attn_kv_a_mqa.weight"].T)
        kv_c = self.rms(kv[:, :L], W[p + "attn_kv_a_norm.weight"])                        # [T, L]
        k_pe = self.rope(kv[:, None, L:].contiguous(), R)[:, 0]                             # [T, R]
        wk_b, wv_b = W[p + "attn_k_b.weight"], W[p + "attn_v_b.weight"]                    # [H, L, nope], [H, Dv, L]
        o = torch.zeros(T, H, Dv, dtype=torch.float64)
        for hd in range(H):
            k_nope = kv_c @ wk_b[hd]                                                          # [T, nope]
            v = kv_c @ wv_b[hd].T                                                             # [T, Dv]
            for t in range(T):
                scores = [float(q[t, hd, :nope] @ k_nope[s] + q_pe[t, hd] @ k_pe[s]) * cfg.kq_scale
                          if s <= t else -math.inf for s in range(T)]
                o[t, hd] = self.attend(scores, v, None)
        return self.r(o.reshape(T, H * Dv))

    def route(self, il: int, x: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        cfg, W, p = self.cfg, self.W, f"blk.{il}."
        logits = W[p + "ffn_gate_inp.weight"] @ x
        for extra in ("ffn_gate_inp.bias", "router_bias"):
            if p + extra in W:
                logits = logits + W[p + extra]
        if cfg.gating == "softmax_weight":
            select = logits
            chosen = sorted(range(cfg.n_expert), key=lambda e: -float(logits[e]))[:cfg.n_expert_used]
            weights = torch.softmax(logits[chosen], dim=0)
        else:
            probs = torch.softmax(logits, 0) if cfg.gating == "softmax" else 1 / (1 + torch.exp(-logits))
            bias = W.get(p + "exp_probs_b.bias")
            select = probs if bias is None else probs + bias
            chosen = sorted(range(cfg.n_expert), key=lambda e: -float(select[e]))[:cfg.n_expert_used]
            weights = probs[chosen]
            if cfg.gating == "softmax":    # probs are ordered as logits: measure the margin in logits
                select = logits if bias is None else logits + bias
        if cfg.norm_topk:
            weights = weights / max(float(weights.sum()), 6.103515625e-5)
        if cfg.expert_weights_scale not in (0.0, 1.0):
            weights = weights * cfg.expert_weights_scale
        if self.routes is not None:
            self.routes.setdefault(il, set()).update(chosen)
        if self.margins is not None:
            ranked = sorted((float(v) for v in select), reverse=True)
            gap = ranked[cfg.n_expert_used - 1] - ranked[cfg.n_expert_used]
            self.margins.append(gap / 0.25 if cfg.gating == "sigmoid" else gap)   # logit units (max slope)
        return chosen, weights

    def moe(self, il: int, x: torch.Tensor) -> torch.Tensor:
        W, p = self.W, f"blk.{il}."
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            chosen, weights = self.route(il, x[t])
            for e, w in zip(chosen, weights):
                g = W[p + "ffn_gate_exps.weight"][e] @ x[t]
                u = W[p + "ffn_up_exps.weight"][e] @ x[t]
                if p + "ffn_gate_exps.bias" in W:
                    g, u = g + W[p + "ffn_gate_exps.bias"][e], u + W[p + "ffn_up_exps.bias"][e]
                y = W[p + "ffn_down_exps.weight"][e] @ self.r(_act(self.r(g), self.r(u), self.cfg.activation))
                if p + "ffn_down_exps.bias" in W:
                    y = y + W[p + "ffn_down_exps.bias"][e]
                out[t] += w * y
        return self.r(out)

    def swiglu(self, prefix: str, suffix: str, x: torch.Tensor) -> torch.Tensor:
        W = self.W
        g = self.r(x @ W[f"{prefix}ffn_gate{suffix}.weight"].T)
        u = self.r(x @ W[f"{prefix}ffn_up{suffix}.weight"].T)
        return self.r(self.r(_act(g, u, "silu")) @ W[f"{prefix}ffn_down{suffix}.weight"].T)

    def forward(self, tokens: list[int]) -> torch.Tensor:
        cfg, W = self.cfg, self.W
        x = W["token_embd.weight"][tokens]
        for il in range(cfg.n_layer):
            p = f"blk.{il}."
            h = self.rms(x, W[p + "attn_norm.weight"])
            o = self.mla(il, h) if cfg.is_mla else self.attention(il, h)
            x = x + self.linear(p + "attn_output", o)
            post = "post_attention_norm" if cfg.arch == "gpt-oss" else "ffn_norm"
            hn = self.rms(x, W[p + post + ".weight"])
            if cfg.moe_layers[il]:
                ffn = self.moe(il, hn)
                if p + "ffn_down_shexp.weight" in W:
                    sh = self.swiglu(p, "_shexp", hn)
                    if cfg.shexp_gate:
                        sh = sh / (1 + torch.exp(-(hn @ W[p + "ffn_gate_inp_shexp.weight"])))[:, None]
                    ffn = ffn + sh
            else:
                ffn = self.swiglu(p, "", hn)
            x = x + ffn
        out_w = W["token_embd.weight"] if cfg.tied_output else W["output.weight"]
        return self.r(self.rms(x, W["output_norm.weight"]) @ out_w.T)
