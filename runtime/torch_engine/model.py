"""The forward pass of qwen3moe, qwen2moe, deepseek2 and gpt-oss, built as a Program of ops for one ubatch.

Each op reads and writes named activations and runs on one device, decided by the scheduler's rules from where
its weights live and the op's batch (see scheduler.py). Legend: T tokens of the ubatch, D n_embd, H heads,
Hkv KV heads, Dk/Dv head dims, E experts, A used per token, F n_ff_exp, L kv_lora_rank, R n_rot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from collections.abc import Callable

import torch
import torch.nn.functional as F

from planner.model import ModelInventory
from planner.plan import Plan

from . import kernels as K
from .config import ModelConfig
from .placement import (
    Counters, Devices, LayerCache, PlacedWeights, Stager, is_gpu, model_bytes_of, replica, runs_of,
)
from .scheduler import OffloadRules, Program, ProgramBuilder
from .weights import WeightSource


@dataclass
class Runtime:
    """Everything a forward pass reads: the model, its placement, caches, upload machinery and helpers."""
    cfg: ModelConfig
    inv: ModelInventory
    plan: Plan
    devices: Devices
    weights: PlacedWeights
    caches: list[LayerCache]
    stagers: dict[str, Stager]
    counters: Counters
    source: WeightSource
    dtype: torch.dtype
    threads: int
    rules: OffloadRules
    output_device: str
    max_pos: int
    fast: dict[str, Callable] = field(default_factory=dict)     # compiled decode helpers (CUDA)
    _rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _router_bias: dict[tuple[int, str], torch.Tensor | None] = field(default_factory=dict)

    def rope(self, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables for every position the run can reach, on `dev`."""
        if dev not in self._rope:
            self._rope[dev] = K.rope_tables(self.max_pos, self.cfg.n_rot, self.cfg.rope_base, self.devices.torch(dev))
        return self._rope[dev]

    def router_bias(self, layer: int, dev: str) -> torch.Tensor | None:
        key = (layer, dev)
        if key not in self._router_bias:
            b = self.source.router_bias(layer)
            self._router_bias[key] = None if b is None else b.to(self.devices.torch(dev))
        return self._router_bias[key]


@dataclass
class Use:
    """A weight an op reads: the placed tensor (or packed buffer), where it lives, the model tensors it holds."""
    tensor: torch.Tensor
    device: str
    names: tuple[str, ...]


class _Ready:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def wait(self) -> torch.Tensor:
        return self.t

    def release(self) -> None:
        pass


class ForwardBuilder:
    def __init__(self, rt: Runtime) -> None:
        self.rt, self.cfg = rt, rt.cfg

    # ---- weights as an op sees them ----------------------------------------------------------------------------------

    def uses(self, names: list[str]) -> list[Use]:
        """Placed tensors for `names`: one packed buffer when they were packed together, else one per name."""
        w = self.rt.weights
        present = [n for n in names if w.has(n)]
        if len(present) > 1:
            buf = w.packed(tuple(present))
            if buf is not None:
                return [Use(buf.storage, buf.device, buf.names)]
        return [Use(w.get(n), w.device_of[n], (n,)) for n in present]

    def fetcher(self, uses: list[Use], run: str, experts: bool = False) -> Callable[..., list]:
        """fetch(active=None) -> handles with .wait()/.release(), one per use, on device `run`: the placed tensor,
        or an upload into a staging buffer (of the listed experts only when `active` is given)."""
        rt = self.rt
        plan_uses = []
        for u in uses:
            if u.device == run:
                plan_uses.append(("direct", u))
            elif not is_gpu(u.device) and is_gpu(run):
                plan_uses.append(("upload", u))
            else:   # a small tensor on another device than its op (e.g. a bias): keep a copy there
                copy = u.tensor.to(rt.devices.torch(run), copy=True)
                plan_uses.append(("direct", Use(copy, run, u.names)))
        n_expert = max(self.cfg.n_expert, 1)

        def fetch(active: list[int] | None = None) -> list:
            out = []
            for how, u in plan_uses:
                if how == "direct":
                    out.append(_Ready(u.tensor))
                    continue
                runs = runs_of(active) if (experts and active is not None) else None
                frac = len(active) / n_expert if runs is not None else 1.0
                out.append(rt.stagers[run].start(u.tensor, runs, model_bytes_of(rt.inv, u.names, frac)))
            return out
        return fetch

    def helper(self, name: str, run: str) -> Callable | None:
        """A compiled fusion of small ops (make_fast_helpers) for an op on `run`, or None: every op of a decode
        program (CUDA graphs), and the GPU ops of a prompt ubatch (there the eager fp32 norms, RoPE and routing
        are several full-size passes each)."""
        if self.fast or (self.T > 1 and is_gpu(run)):
            return self.rt.fast.get(name)
        return None

    # ---- the program -------------------------------------------------------------------------------------------------

    def build(self, T: int, n_out: int, n_kv: int, fast: bool = False) -> Program:
        """Ops for a ubatch of T tokens at positions `pos` (per device), logits of its last n_out tokens;
        full-attention layers attend to the first n_kv cells."""
        rt, cfg = self.rt, self.cfg
        b = ProgramBuilder(rt.devices, rt.counters, per_device_inputs=("pos",))
        b.external("tokens", "CPU")
        self.b, self.T, self.fast, self.n_kv = b, T, fast, n_kv
        self._masks: set[str] = set()
        emb = rt.weights.get("token_embd.weight")
        # the residual stream is float32 (as ggml's activations) from the first add on; the embedding rows keep
        # the compute dtype (half the bytes to the GPU); matmul inputs are in the compute dtype
        b.add("token_embd", rt.weights.device_of["token_embd.weight"], "get_rows", ("tokens",), ("x",),
              lambda tok: emb.index_select(0, tok.to(emb.device)))
        self.norm("blk.0.attn_norm.weight", "x", "0.h", T)
        for il in range(cfg.n_layer):
            self.layer(il, n_out if il == cfg.n_layer - 1 else T)
        self.output(n_out)
        return b.finish(("logits", "next"))

    def layer(self, il: int, t_out: int) -> None:
        """Layer il from its normed input f"{il}.h" (and residual "x") to the next layer's normed input (or the
        output norm's), each residual add fused with the norm after it when both run on the layer's device."""
        cfg, p = self.cfg, f"blk.{il}."
        home = self.rt.caches[il].device
        T = self.T
        if cfg.is_mla:
            self.mla(il)
        else:
            self.attention(il)
        self.linear([p + "attn_output.weight"], [p + "attn_output.bias"], f"{il}.o", [f"{il}.a"], T)
        rows = slice(T - t_out, None) if t_out < T else None   # llama.cpp's last layer keeps the output rows only
        post = "post_attention_norm.weight" if cfg.arch == "gpt-oss" else "ffn_norm.weight"
        self.add_norm(p + "add_attn", home, ("x", f"{il}.a"), f"{il}.ffn_inp", p + post, f"{il}.hn", t_out, rows)
        extra: tuple[str, ...] = ()
        if cfg.moe_layers[il]:
            self.moe(il, t_out)
            if self.rt.weights.has(p + "ffn_down_shexp.weight"):
                self.ffn(p, ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"),
                         f"{il}.hn", f"{il}.sh", t_out)
                extra = (f"{il}.sh",)
                if cfg.shexp_gate:
                    self.shexp_gate(il, t_out)
                    extra += (f"{il}.shg",)
        else:
            self.ffn(p, ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"), f"{il}.hn", f"{il}.moe", t_out)
        last = il == cfg.n_layer - 1
        nxt, dst = ("output_norm.weight", "xo") if last else (f"blk.{il + 1}.attn_norm.weight", f"{il + 1}.h")
        self.add_norm(p + "add_ffn", home, (f"{il}.ffn_inp", f"{il}.moe") + extra, "x", nxt, dst, t_out)

    def add_norm(self, name: str, home: str, reads: tuple[str, ...], dst: str, norm_name: str, norm_dst: str,
                 batch: int, rows: slice | None = None) -> None:
        """dst = reads[0] + the rest (float32 residual stream; a qwen2moe shared-expert output times its gate),
        then norm_dst = RMSNorm(dst): one op on `home` when the norm runs there too (a compiled kernel in fast
        decode), else the add on `home` and the norm where its weight says."""
        rt, eps, dtype = self.rt, self.cfg.rms_eps, self.rt.dtype
        fused = rt.rules.run_device(norm_name, batch) == home and rt.weights.device_of[norm_name] == home
        fast = self.helper("add_rms", home)

        def add(x: torch.Tensor, a: torch.Tensor, sh: torch.Tensor | None = None,
                g: torch.Tensor | None = None) -> torch.Tensor:
            if rows is not None:
                x, a = x[rows], a[rows]
            out = x + a.float()
            if sh is not None:
                out = out + (sh.float() * g.float() if g is not None else sh.float())
            return out
        if not fused:
            self.b.add(name, home, "glue", reads, (dst,), add)
            self.norm(norm_name, dst, norm_dst, batch)
            return
        w = rt.weights.get(norm_name)

        def add_then_norm(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if fast is not None:
                if rows is not None:
                    args = (args[0][rows], args[1][rows]) + args[2:]
                return fast(w, *args)
            out = add(*args)
            return out, K.rms_norm(out, w, eps, dtype)
        self.b.add(name + "+" + norm_name, home, "norm", reads, (dst, norm_dst), add_then_norm)

    def output(self, n_out: int) -> None:
        rt, b = self.rt, self.b
        self.norm("output_norm.weight", "x", "xo", n_out)
        dev = rt.output_device
        if rt.inv.tied_output:
            w = rt.weights.replicas.get(("token_embd.weight", dev), rt.weights.get("token_embd.weight"))
            use, wname = Use(w, dev, ("token_embd.weight",)), "token_embd.weight"
        else:
            use, wname = self.uses(["output.weight"])[0], "output.weight"
        run = rt.rules.run_device(wname, n_out, "output", weight_device=use.device)
        fetch = self.fetcher([use], run)

        def out_fn(x: torch.Tensor) -> torch.Tensor:
            (h,) = fetch()
            y = F.linear(x, h.wait()).float()
            h.release()
            return y
        b.add("output", run, "output", ("xo",), ("logits",), out_fn, offloaded=run != use.device)
        b.add("argmax", run, "glue", ("logits",), ("next",), lambda lg: lg.argmax(-1))

    # ---- building blocks ---------------------------------------------------------------------------------------------

    def norm(self, name: str, src: str, dst: str, batch: int) -> None:
        rt, eps = self.rt, self.cfg.rms_eps
        dev = rt.weights.device_of[name]
        run = rt.rules.run_device(name, batch)
        fetch = self.fetcher(self.uses([name]), run)
        rms = self.helper("rms_norm", run) or K.rms_norm
        dtype = rt.dtype

        def fn(x: torch.Tensor) -> torch.Tensor:
            (h,) = fetch()
            y = rms(x, h.wait(), eps, dtype)
            h.release()
            return y
        self.b.add(name, run, "norm", (src,), (dst,), fn, offloaded=run != dev)

    def linear(self, names: list[str], bias_names: list[str], src: str, dsts: list[str], batch: int,
               op_class: str = "dense_matmul") -> None:
        """y = x W^T + b for weights read together (packed Q/K/V or gate/up), split into dsts by width.
        Weights that are not on one device become one op each (as ggml runs each MUL_MAT where its weight is)."""
        rt = self.rt
        names = [n for n in names if rt.weights.has(n)]
        devs = {rt.rules.run_device(n, batch) for n in names}
        if len(devs) > 1:
            for n, bn, d in zip(names, bias_names + [""] * len(names), dsts):
                self.linear([n], [bn], src, [d], batch, op_class)
            return
        run = devs.pop()
        w_uses = self.uses(names)
        biases = [n for n in bias_names if n and rt.weights.has(n)]
        b_uses = self.uses(biases) if biases else []
        fetch = self.fetcher(w_uses + b_uses, run)
        n_w = len(w_uses)
        widths = [rt.weights.get(n).shape[0] for n in names]
        offloaded = any(u.device != run for u in w_uses)

        def fn(x: torch.Tensor):
            hs = fetch()
            ws = [h.wait() for h in hs]
            w = ws[0] if n_w == 1 else torch.cat(ws[:n_w], 0)
            bias = None
            if len(ws) > n_w:
                bias = ws[n_w] if len(ws) == n_w + 1 else torch.cat(ws[n_w:], 0)
            y = F.linear(x, w, bias)
            for h in hs:
                h.release()
            return y if len(widths) == 1 else tuple(torch.split(y, widths, dim=-1))
        self.b.add("+".join(names) if len(names) > 1 else names[0], run, op_class, (src,), tuple(dsts), fn,
                   offloaded=offloaded)

    def _mask(self, dev: str) -> str:
        key = f"mask.{dev}"
        if dev not in self._masks:
            n_kv = self.n_kv
            self.b.add(key, dev, "glue", ("pos",), (key,), lambda pos: K.causal_mask(pos, n_kv))
            self._masks.add(dev)
        return key

    def attention(self, il: int) -> None:
        rt, cfg, p = self.rt, self.cfg, f"blk.{il}."
        cache = rt.caches[il]
        home = cache.device
        self.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                    [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"], f"{il}.h",
                    [f"{il}.q", f"{il}.k", f"{il}.v"], self.T)
        H, Hkv, Dk, Dv = cfg.n_head, cfg.n_head_kv[il], cfg.head_dim_k, cfg.head_dim_v
        qn = replica(rt.weights, p + "attn_q_norm.weight", home, rt.devices) if cfg.qk_norm else None
        kn = replica(rt.weights, p + "attn_k_norm.weight", home, rt.devices) if cfg.qk_norm else None
        sinks = replica(rt.weights, p + "attn_sinks.weight", home, rt.devices) if cfg.sinks else None
        cos_t, sin_t = rt.rope(home)
        eps, n_rot, kind, scale, n_kv, n_swa = cfg.rms_eps, cfg.n_rot, cfg.rope_type, cfg.kq_scale, self.n_kv, cfg.n_swa
        prep: Callable | None
        if rt.devices.torch(home).type == "cuda" and K.triton_ok():     # one Triton kernel each for Q and K
            def prep(q, k, pos, cos_t, sin_t, qn, kn):
                return (K.qk_rope(q, qn, pos, cos_t, sin_t, eps, n_rot, kind),
                        K.qk_rope(k, kn, pos, cos_t, sin_t, eps, n_rot, kind))
        else:
            prep = self.helper("qk_prep", home)
        # a whole prompt ubatch from position 0 (n_kv == T implies pos0 == 0): flash attention, causal, no mask
        causal = not cache.swa and sinks is None and n_kv == self.T and self.T > 1
        # one decode token on CUDA: the KV write and the attention in Triton (split over the cache, merged), no mask
        one = (self.fast and self.T == 1 and not cache.swa and sinks is None and K.triton_ok()
               and rt.devices.torch(home).type == "cuda")

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
            T = q.shape[0]
            q, k, v = q.view(T, H, Dk), k.view(T, Hkv, Dk), v.view(T, Hkv, Dv)       # [T, H, Dk] ...
            if prep is not None:
                q, k = prep(q, k, pos, cos_t, sin_t, qn, kn)
            else:
                cs, sn = cos_t.index_select(0, pos), sin_t.index_select(0, pos)
                if qn is not None:
                    q, k = K.rms_norm(q, qn, eps), K.rms_norm(k, kn, eps)
                q, k = K.rope(q, cs, sn, n_rot, kind), K.rope(k, cs, sn, n_rot, kind)
            if one:
                return K.decode_attention(q[0], k[0], v[0], cache.k, cache.v, pos, scale, n_kv).reshape(1, H * Dv)
            if cache.swa:
                cell = pos % cache.cells
                cache.cell_pos.index_copy_(0, cell, pos)
                mask = K.window_mask(pos, cache.cell_pos, n_swa)
                kk, vv = cache.k, cache.v
            else:
                cell = pos
                kk, vv = cache.k[:, :n_kv], cache.v[:, :n_kv]                             # [Hkv, N, Dk]
            cache.k.index_copy_(1, cell, k.transpose(0, 1).to(cache.k.dtype))
            cache.v.index_copy_(1, cell, v.transpose(0, 1).to(cache.v.dtype))
            if causal:
                return K.causal_attention(q, kk, vv, scale).reshape(T, H * Dv)
            return K.attention(q, kk, vv, mask, scale, sinks).reshape(T, H * Dv)
        reads = (f"{il}.q", f"{il}.k", f"{il}.v", "pos") + (() if cache.swa or causal or one else (self._mask(home),))
        self.b.add(p + "attn", home, "attention", reads, (f"{il}.o",), core)

    def mla(self, il: int) -> None:
        """DeepSeek MLA with the absorbed latent cache: K = [norm(kv_c) | rope(k_pe)] (L + R per token, one
        head), V = kv_c; q_nope is absorbed through attn_k_b, the output expanded through attn_v_b."""
        rt, cfg, p = self.rt, self.cfg, f"blk.{il}."
        cache = rt.caches[il]
        home = cache.device
        T = self.T
        if cfg.q_lora_rank:
            self.linear([p + "attn_q_a.weight"], [], f"{il}.h", [f"{il}.qa"], T)
            self.norm(p + "attn_q_a_norm.weight", f"{il}.qa", f"{il}.qan", T)
            self.linear([p + "attn_q_b.weight"], [], f"{il}.qan", [f"{il}.q"], T)
        else:
            self.linear([p + "attn_q.weight"], [], f"{il}.h", [f"{il}.q"], T)
        self.linear([p + "attn_kv_a_mqa.weight"], [], f"{il}.h", [f"{il}.kv"], T)
        H, L, R = cfg.n_head, cfg.kv_lora_rank, cfg.n_rot
        Dk, Dv = cfg.head_dim_k_mla, cfg.head_dim_v_mla
        nope = Dk - R
        kv_norm = replica(rt.weights, p + "attn_kv_a_norm.weight", home, rt.devices)
        wk_b = replica(rt.weights, p + "attn_k_b.weight", home, rt.devices)       # [H, L, nope]
        wv_b = replica(rt.weights, p + "attn_v_b.weight", home, rt.devices)       # [H, Dv, L]
        cos_t, sin_t = rt.rope(home)
        eps, kind, scale, n_kv = cfg.rms_eps, cfg.rope_type, cfg.kq_scale, self.n_kv

        def core(q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            T = q.shape[0]
            q = q.view(T, H, Dk)
            cs, sn = cos_t.index_select(0, pos), sin_t.index_select(0, pos)
            q_pe = K.rope(q[..., nope:], cs, sn, R, kind)                                 # [T, H, R]
            kv_c = K.rms_norm(kv[:, :L], kv_norm, eps)                                    # [T, L]
            k_pe = K.rope(kv[:, None, L:], cs, sn, R, kind)[:, 0]                         # [T, R]
            q_abs = torch.bmm(q[..., :nope].transpose(0, 1), wk_b.transpose(1, 2))      # [H, T, L]
            qq = torch.cat([q_abs.transpose(0, 1), q_pe], dim=-1)                         # [T, H, L + R]
            cache.latent.index_copy_(0, pos, torch.cat([kv_c, k_pe], dim=-1).to(cache.latent.dtype))
            lat = cache.latent[:n_kv]                                                      # [N, L + R]
            o = K.attention(qq, lat.unsqueeze(0), lat[:, :L].unsqueeze(0), mask, scale)  # [T, H, L]
            o = torch.bmm(o.transpose(0, 1), wv_b.transpose(1, 2))                        # [H, T, Dv]
            return o.transpose(0, 1).reshape(T, H * Dv)
        self.b.add(p + "attn", home, "attention", (f"{il}.q", f"{il}.kv", "pos", self._mask(home)),
                   (f"{il}.o",), core)

    def ffn(self, p: str, suffixes: tuple[str, str, str], src: str, dst: str, batch: int) -> None:
        """Dense or shared-expert SwiGLU FFN (SiLU in every arch modelled): gate and up (one op when they share a
        device), then the activation and down on down's device."""
        rt = self.rt
        gate, up, down = (p + s for s in suffixes)
        self.linear([gate, up], [], src, [dst + ".g", dst + ".u"], batch)
        run = rt.rules.run_device(down, batch)
        fetch = self.fetcher(self.uses([down]), run)

        def down_fn(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            h = (F.silu(g.float()) * u.float()).to(g.dtype)
            (w,) = fetch()
            y = F.linear(h, w.wait())
            w.release()
            return y
        self.b.add(down, run, "dense_matmul", (dst + ".g", dst + ".u"), (dst,), down_fn,
                   offloaded=run != rt.weights.device_of[down])

    def shexp_gate(self, il: int, batch: int) -> None:
        """qwen2moe: the shared expert's output is scaled by sigmoid(x . ffn_gate_inp_shexp)."""
        name = f"blk.{il}.ffn_gate_inp_shexp.weight"
        rt = self.rt
        run = rt.rules.run_device(name, batch)
        fetch = self.fetcher(self.uses([name]), run)

        def fn(x: torch.Tensor) -> torch.Tensor:
            (w,) = fetch()
            g = torch.sigmoid(x.float() @ w.wait().float().unsqueeze(-1))             # [T, 1]
            w.release()
            return g
        self.b.add(name, run, "dense_matmul", (f"{il}.hn",), (f"{il}.shg",), fn,
                   offloaded=run != rt.weights.device_of[name])

    def moe(self, il: int, T: int) -> None:
        rt, cfg, p = self.rt, self.cfg, f"blk.{il}."
        # router: logits (+ gpt-oss bias, + synthetic hot-expert bias) -> top-k ids and weights
        rname = p + "ffn_gate_inp.weight"
        run_r = rt.rules.run_device(rname, T)
        fetch_r = self.fetcher(self.uses([rname]) + self.uses([p + "ffn_gate_inp.bias"]), run_r)
        probs_b = (replica(rt.weights, p + "exp_probs_b.bias", run_r, rt.devices)
                   if rt.weights.has(p + "exp_probs_b.bias") else None)
        zb = rt.router_bias(il, run_r)
        A, gating, norm, scale = cfg.n_expert_used, cfg.gating, cfg.norm_topk, cfg.expert_weights_scale
        route = self.helper("route", run_r)
        triton_select = rt.devices.torch(run_r).type == "cuda" and K.triton_ok() and A & (A - 1) == 0
        triton_route = self.fast and triton_select and run_r == rt.weights.device_of[rname]
        gate_bias = (replica(rt.weights, p + "ffn_gate_inp.bias", run_r, rt.devices)
                     if rt.weights.has(p + "ffn_gate_inp.bias") else None)
        logit_bias = gate_bias if zb is None else (zb if gate_bias is None else gate_bias + zb)
        w_router = rt.weights.get(rname)

        def router(x: torch.Tensor):
            if triton_route:    # CUDA decode: GEMV + selection, two kernels
                return K.route_fast(x, w_router, logit_bias, A, gating, norm, scale, probs_b)
            hs = fetch_r()
            ws = [h.wait() for h in hs]
            logits = F.linear(x.float(), ws[0], ws[1] if len(ws) > 1 else None)           # [T, E] float32
            for h in hs:
                h.release()
            if zb is not None:
                logits = logits + zb
            if triton_select:   # CUDA prompt ubatch: the selection in one kernel
                return K.select(logits, None, A, gating, norm, scale, probs_b)
            if route is not None:
                return route(logits, probs_b)
            return K.route(logits, A, gating, norm, scale, probs_b)
        self.b.add(rname, run_r, "dense_matmul", (f"{il}.hn",), (f"{il}.ids", f"{il}.w"), router,
                   offloaded=run_r != rt.weights.device_of[rname])

        # routed experts
        names = [p + s for s in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")]
        runs = [rt.rules.run_device(n, T) for n in names]
        if len(set(runs)) == 1:
            self._experts_fused(il, T, runs[0])
        else:
            self._experts_split(il, T, runs)

    def _expert_parts(self, il: int) -> tuple[list[Use], list[Use], Use, Use | None]:
        p = f"blk.{il}."
        up = self.uses([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"])
        up_b = self.uses([p + "ffn_gate_exps.bias", p + "ffn_up_exps.bias"])
        down = self.uses([p + "ffn_down_exps.weight"])[0]
        down_b = self.uses([p + "ffn_down_exps.bias"])
        return up, up_b, down, (down_b[0] if down_b else None)

    def _active(self, run: str, uses: list[Use]) -> bool:
        """Whether an expert op on `run` uploads only the routed experts (knob only_active_experts)."""
        return self.rt.plan.knobs.only_active_experts and any(u.device != run for u in uses)

    def _experts_fused(self, il: int, T: int, run: str) -> None:
        rt, cfg = self.rt, self.cfg
        up, up_b, down, down_b = self._expert_parts(il)
        uses = up + up_b + [down] + ([down_b] if down_b else [])
        fetch = self.fetcher(uses, run, experts=True)
        n_up, n_upb = len(up), len(up_b)
        only_active = self._active(run, uses)
        n_ff, act, threads, dtype, n_expert = cfg.n_ff_exp, cfg.activation, rt.threads, rt.dtype, cfg.n_expert
        on_cuda = rt.devices.torch(run).type == "cuda"
        gemv_fast = (self.fast and on_cuda and K.triton_ok() and n_up == 1
                     and not n_upb and down_b is None and "act" in rt.fast)
        act_fast = rt.fast.get("act")
        use_grouped = n_up <= 2 and not n_upb and down_b is None
        grouped = partial(K.grouped_experts, act_fn=self.helper("act", run),
                          combine_fn=K.combine if on_cuda and K.triton_ok()
                          else self.helper("combine", run) or K.unsort_combine)

        def experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            active = active_experts(ids, n_expert) if only_active else None
            hs = fetch(active)
            if use_grouped and K.grouped_ok(x.device, x.shape[0], x.dtype):     # CUDA prompt batches
                tables = [h.wait() for h in hs[:n_up]]
                y = K.CAPABILITIES.run("grouped_mm", x.device, grouped, _unfused, x, ids, w, tables,
                                       hs[-1].wait(), n_ff, act)
                for hh in hs:
                    hh.release()
                return y
            if gemv_fast:      # CUDA decode: three kernels (GEMV, activation, GEMV with the weighted sum)
                h = act_fast(K.moe_gemv(x, ids, hs[0].wait(), per_pair=False))
                y = K.moe_down_combine(h, ids, w, hs[1].wait())
                for hh in hs:
                    hh.release()
                return y
            tables = [h.wait() for h in hs[:n_up]]
            biases = [h.wait() for h in hs[n_up:n_up + n_upb]] or [None]
            gu = K.experts_up(x, ids, tables, biases, threads)                          # [P, 2F] float32
            h = K.activation(gu, n_ff, act).to(dtype)                                   # [P, F]
            rest = [hh.wait() for hh in hs[n_up + n_upb:]]
            y = K.experts_down(h, ids, w, rest[0], rest[1] if len(rest) > 1 else None, threads)   # [T, D]
            for hh in hs:
                hh.release()
            return y                                                                 # float32
        syncs = only_active or (rt.devices.torch(run).type == "cuda" and K.cuda_syncs(T, dtype))
        self.b.add(f"blk.{il}.ffn_moe", run, "moe_matmul", (f"{il}.hn", f"{il}.ids", f"{il}.w"), (f"{il}.moe",),
                   experts, offloaded=any(u.device != run for u in uses), host_sync=syncs,
                   scratch=grouped_scratch(cfg, T, dtype, n_up) if use_grouped and is_gpu(run) else 0)

    def _experts_split(self, il: int, T: int, runs: list[str]) -> None:
        """Gate, up and down of one layer run on different devices: one op per device, activations in between."""
        rt, cfg, p = self.rt, self.cfg, f"blk.{il}."
        threads, n_expert = rt.threads, cfg.n_expert
        if runs[0] == runs[1]:
            groups = [(["gate", "up"], runs[0])]
        else:
            groups = [(["gate"], runs[0]), (["up"], runs[1])]
        parts = []
        for suffixes, run in groups:
            w_uses = self.uses([p + f"ffn_{s}_exps.weight" for s in suffixes])
            uses = w_uses + self.uses([p + f"ffn_{s}_exps.bias" for s in suffixes])
            n_w = len(w_uses)
            fetch = self.fetcher(uses, run, experts=True)
            only_active = self._active(run, uses)

            def up_fn(x: torch.Tensor, ids: torch.Tensor, fetch=fetch, only_active=only_active, n_w=n_w):
                hs = fetch(active_experts(ids, n_expert) if only_active else None)
                ws = [h.wait() for h in hs]
                y = K.experts_up(x, ids, ws[:n_w], ws[n_w:] or [None], threads)
                for h in hs:
                    h.release()
                return y
            key = f"{il}.moe_" + "_".join(suffixes)
            self.b.add(p + "ffn_" + "_".join(suffixes) + "_exps", run, "moe_matmul", (f"{il}.hn", f"{il}.ids"),
                       (key,), up_fn, offloaded=any(u.device != run for u in uses), host_sync=only_active)
            parts.append(key)
        run = runs[2]
        uses = self.uses([p + "ffn_down_exps.weight"]) + self.uses([p + "ffn_down_exps.bias"])
        fetch = self.fetcher(uses, run, experts=True)
        only_active = self._active(run, uses)
        n_ff, act, dtype = cfg.n_ff_exp, cfg.activation, rt.dtype

        def down_fn(*args: torch.Tensor) -> torch.Tensor:
            *gu, ids, w = args
            h = K.activation(gu[0] if len(gu) == 1 else torch.cat(gu, dim=-1), n_ff, act).to(dtype)
            hs = fetch(active_experts(ids, n_expert) if only_active else None)
            ws = [hh.wait() for hh in hs]
            y = K.experts_down(h, ids, w, ws[0], ws[1] if len(ws) > 1 else None, threads)
            for hh in hs:
                hh.release()
            return y                                                                 # float32
        self.b.add(p + "ffn_down_exps", run, "moe_matmul", tuple(parts) + (f"{il}.ids", f"{il}.w"),
                   (f"{il}.moe",), down_fn, offloaded=any(u.device != run for u in uses), host_sync=only_active)


def active_experts(ids: torch.Tensor, n_expert: int) -> list[int]:
    """The experts a ubatch routes to (sorted); on the meta device (a dry run: no values) every expert, which
    uploads into the same staging buffer (an upload of some experts fills a buffer shaped as the whole stack)."""
    if ids.device.type == "meta":
        return list(range(n_expert))
    return torch.unique(ids).tolist()


def grouped_scratch(cfg: ModelConfig, T: int, dtype: torch.dtype, n_up: int) -> int:
    """Bytes K.grouped_experts holds on a GPU for a T-token ubatch beyond its input and output, at its fullest:
    the P = T x n_expert_used rows sorted by expert (D wide), gate|up (2F; while two tables are concatenated, both
    halves and the whole), the activation (F) and the down product (D), in the compute dtype. 0 where the GPU
    takes another path (T under GROUPED_MIN_T: the Triton GEMVs; not bf16). Seen on two H100s
    (benchmarks/reported/torch_memory_probe_h100x2.md): 28 + 16 + 6 MiB at 512 tokens of the Qwen3-30B-A3B shape,
    112 + 64 + 24 at 2048, as this gives."""
    if T < K.GROUPED_MIN_T or dtype != torch.bfloat16:
        return 0
    P, D, F = T * cfg.n_expert_used, cfg.n_embd, cfg.n_ff_exp
    cat = D + 4 * F if n_up == 2 else 0
    return P * max(2 * D + 3 * F, cat) * dtype.itemsize


def _unfused(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, tables: list[torch.Tensor], down: torch.Tensor,
             n_ff: int, act: str) -> torch.Tensor:
    """grouped_experts' fallback: the per-expert loop."""
    gu = K.experts_up(x, ids, tables, [None])
    return K.experts_down(K.activation(gu, n_ff, act).to(x.dtype), ids, w, down)


def make_fast_helpers(cfg: ModelConfig, dtype: torch.dtype, enabled: bool, compile: bool = True
                      ) -> dict[str, Callable]:
    """torch.compile'd fusions of the small decode ops (one kernel each instead of several) for CUDA graphs.
    Every tensor is an argument (never a closure variable), so all layers share one compiled graph.
    compile=False gives the same functions uncompiled (tests run the fast-path program on the CPU)."""
    if not enabled:
        return {}
    eps, n_rot, kind = cfg.rms_eps, cfg.n_rot, cfg.rope_type
    A, gating, norm, scale, n_ff, act = (cfg.n_expert_used, cfg.gating, cfg.norm_topk, cfg.expert_weights_scale,
                                         cfg.n_ff_exp, cfg.activation)

    def rms(x: torch.Tensor, w: torch.Tensor, eps_: float, dtype_: torch.dtype) -> torch.Tensor:
        return K.rms_norm(x, w, eps_, dtype_)

    def add_rms(w, x, a, sh=None, g=None):
        out = x + a.float()
        if sh is not None:
            out = out + (sh.float() * g.float() if g is not None else sh.float())
        return out, K.rms_norm(out, w, eps, dtype)

    def qk_prep(q, k, pos, cos_t, sin_t, qn, kn):
        cs, sn = cos_t.index_select(0, pos), sin_t.index_select(0, pos)
        if qn is not None:
            q, k = K.rms_norm(q, qn, eps), K.rms_norm(k, kn, eps)
        return K.rope(q, cs, sn, n_rot, kind), K.rope(k, cs, sn, n_rot, kind)

    def route(logits, probs_b):
        return K.route(logits, A, gating, norm, scale, probs_b)

    def act_fn(gu):                             # [P, 2F] -> [P, F] in the compute dtype
        return K.activation(gu, n_ff, act).to(dtype)

    return {"rms_norm": K.maybe_compiled(rms, compile), "add_rms": K.maybe_compiled(add_rms, compile),
            "qk_prep": K.maybe_compiled(qk_prep, compile), "route": K.maybe_compiled(route, compile),
            "act": K.maybe_compiled(act_fn, compile), "combine": K.maybe_compiled(K.unsort_combine, compile)}
