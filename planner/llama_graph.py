"""llama.cpp's worst-case compute graph for a model, rebuilt in the miniature ggml of planner/ggml_graph.py.

The builders mirror src/llama-graph.cpp (build_inp_embd, build_norm, build_qkv, build_attn, build_attn_mha,
build_ffn, build_moe_ffn) and the per-architecture graphs in src/models/ (llama.cpp, qwen3moe.cpp,
qwen2moe.cpp, deepseek2.cpp, openai-moe.cpp, glm4-moe.cpp) of the version vendored in llama-cpp-python 0.3.36:
the same tensors, created and expanded in the same order, so that ggml-alloc's replay sees the graph that
sched_reserve sees. Only what changes buffer sizes is kept (names and math parameters are dropped).

What the graph reserve uses (src/llama-context.cpp sched_reserve / graph_reserve):
- n_tokens = min(n_ctx, n_ubatch) with n_ubatch already clamped to n_batch = min(n_ctx, n_batch);
  n_outputs = n_tokens for the prompt graph (n_outputs_max defaults to n_batch), 1 for the token graph.
- the KV cache "full" context: n_kv = the cache size of the layer's cache (SWA layers: the SWA cache).
- flash attention: f16 KQ mask [n_kv, n_tokens], V not transposed; without it an f32 mask, a transposed V
  cache whose store index is [n_tokens * n_embd_v_gqa] i64, and KQ = [n_kv, n_tokens, n_head] f32.
- a quantized K (V) cache whose head size is a multiple of 64 rotates q and k (v and the output) with a
  Hadamard matrix (llama-kv-cache.cpp attn_rot_k/v, llama-impl.h llama_mul_mat_hadamard): a copy each.

The ik dialect (GraphParams.dialect "ik") builds ik_llama.cpp 8337e4cd's graph where it differs in what ggml-alloc
has to hold (src/llama-build-context.cpp; IK_GRAPH below): fused ops replace mainline's chains (one RMS_NORM+MUL,
one MoE up/gate, one weighted expert sum, one dense up/gate), and no tensor is flagged as a graph output (ik
calls ggml_set_output nowhere on these graphs), so result_norm and the logits are freed like any other tensor.
Its attention stores K and V with ggml_cpy (no index inputs), splits the non-flash-attention KQ into heads under
-amb, and for DeepSeek (MLA) is ik's own graph for each -mla (planner/mla_graph.py). Router and inputs are mainline's.
Byte for byte ik's CPU compute buffers (tests/runtime/test_ik_binaries.py) and its H100 logs.

Checked byte for byte against llama.cpp's own buffers (tests/planner/test_memory_llamacpp.py on the CPU build,
tests/planner/test_memory_cuda.py on CUDA logs) for llama, qwen3moe, qwen2moe, deepseek2 (MLA), gpt-oss and
glm4moe. Other architectures (qwen2, qwen3, llama4) use the llama skeleton: llama4's chunked-attention cache,
shared expert and sigmoid-before-FFN routing are not modelled, so its compute estimate is approximate.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .ggml_graph import GT, OUTPUT, Graph
from .hardware import MiB
from .mla_graph import MlaAttention
from .model import ModelInventory

TIED_OUTPUT = "token_embd.weight@output"   # ext name of the duplicated token_embd used as the output
QUANT_KV = frozenset({"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"})
NOT_QUANTIZED = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})   # ggml_is_quantized false

# ik_llama.cpp 8337e4cd: its context flags for fused graph ops (all on by default, src/llama.cpp:7610-7613) and the op
# each builds instead of mainline's chain. Only fused_moe_up_gate is a knob (Knobs.fmoe: -no-fmoe, llama-bench -fmoe
# 0); our renderer never turns the other two off (-no-mmad, -no-fug), so the graph always has them.
IK_GRAPH: dict[str, str] = {
    # llm_build_moe_ffn :1583-1609: up/gate experts of one type (or a merged gate_up tensor, always) -> one
    # MOE_FUSED_UP_GATE [n_ff, n_used, T] (ggml.c ggml_moe_up_gate :7983); off: two MUL_MAT_ID results and
    # FUSED_MUL_UNARY(gate, up), three [n_ff, n_used, T] tensors where the fused op has one
    "fused_moe_up_gate": "MOE_FUSED_UP_GATE",
    # llm_build_moe_ffn :1668-1678: MUL_MULTI_ADD(experts, weights) -> [n_embd, T] (ggml.c ggml_mul_multi_add
    # :6267), where mainline multiplies into a second [n_embd, n_used, T] and adds n_used views
    "fused_mmad": "MUL_MULTI_ADD",
    # llm_build_ffn :1242-1249: quantized up and gate of one type and shape -> one FUSED_UP_GATE [n_ff, T]
    # (ggml.c ggml_fused_up_gate :8087); otherwise both MUL_MATs and FUSED_MUL_UNARY(gate, up)
    "fused_up_gate": "FUSED_UP_GATE",
}



@dataclass(frozen=True)
class GraphParams:
    n_tokens: int
    n_outputs: int
    flash_attn: bool
    type_k: str
    type_v: str
    kv_cells: tuple[int, ...]       # per layer: cells of the cache the layer attends (its n_kv)
    swa_cells: int = 0              # cells of the SWA cache (gpt-oss), 0 without one
    base_cells: int = 0             # cells of the non-SWA cache
    layers: tuple[int, ...] | None = None   # the layers to build, in order (None: all); see memory.py
    dialect: str = "mainline"       # "ik": ik_llama.cpp's fused graph (IK_GRAPH)
    fmoe: bool = True               # ik's fused_moe_up_gate (Knobs.fmoe)
    mla: int = 3                    # ik's -mla (MLA models): 1, 2 or 3 (mla_graph.IK_MLA)
    amb: int = 0                    # ik's -amb: attention max batch in MiB, 0 = off (ik's non-FA attention)
    gpu_build: bool = False         # ik's context has a GPU backend (its MLA prompt path then casts K/V to f16)


class _Builder(MlaAttention):
    """One graph: the model's weights as external tensors, the inputs, the layers, the output."""

    def __init__(self, inv: ModelInventory, p: GraphParams) -> None:
        self.inv, self.p, self.hp = inv, p, inv.hparams
        self.g = Graph()
        self.T = p.n_tokens
        self._w: dict[str, GT] = {}
        self.ik = p.dialect == "ik"

    # ---- helpers ----

    def w(self, name: str) -> GT | None:
        t = self._w.get(name)
        if t is None:
            spec = self.inv.by_name.get(name)
            if spec is None:
                return None
            t = self._w[name] = Graph.weight(name, spec.shape, spec.nbytes)
        return t

    def lw(self, il: int, suffix: str) -> GT | None:
        return self.w(f"blk.{il}.{suffix}")

    def wtype(self, w: GT) -> str:
        return self.inv.by_name[w.name].ggml_type

    def output_flag(self, t: GT) -> None:
        """res->t_logits, t_embd ...: mainline marks them graph outputs (never freed, never reused in place); ik
        marks nothing (no ggml_set_output in its llm_build_context), so ggml-alloc frees them after their use."""
        if not self.ik:
            t.flags |= OUTPUT

    def norm(self, x: GT, weight: GT | None, name: str = "norm") -> GT:
        g = self.g
        if self.ik and weight is not None:
            # ik llm_build_norm (llama-build-context.cpp:1049-1055): RMS norm and weight in one FUSED_RMS_NORM, an op
            # ggml-alloc never runs in place (ik ggml-alloc.c ggml_op_can_inplace): a new [n_embd, T] where mainline
            # overwrites its source when that source has no other use (the output norm of the last layer's l_out)
            return g.binary("FUSED_RMS_NORM", x, weight, name=name)
        cur = g.unary("RMS_NORM", x, name=name)
        if weight is not None:
            cur = g.binary("MUL", cur, weight, name=name + "_w")
        return cur

    def mm(self, w: GT, x: GT, bias: GT | None = None, name: str = "") -> GT:
        cur = self.g.mul_mat(w, x, name=name)
        if bias is not None:
            cur = self.g.binary("ADD", cur, bias, name=name + "_b")
        return cur

    # ---- inputs (llama-graph.cpp build_inp_*) ----

    def inputs(self) -> None:
        g, T, E = self.g, self.T, self.hp.n_embd
        tokens = Graph.input("inp_tokens", (T,), "i32")
        cur = g.get_rows(self.w("token_embd.weight"), tokens, name="embd")
        g.expand(cur)                 # ggml_build_forward_select: both alternatives, the token path first
        if not self.ik:               # ik builds only the path of the batch it is given: tokens (llama-build-
            g.expand(Graph.input("inp_embd", (E, T), "f32"))   # context.cpp:884-894 llm_build_inp_embd)
        self.inpL = cur
        self.pos = Graph.input("inp_pos", (T,), "i32")

    def kv_inputs(self, cells: int, tag: str, with_v: bool = True) -> dict[str, GT | None]:
        """build_input_k_idxs / v_idxs / build_attn_inp_kq_mask / build_input_k_rot / v_rot of one cache."""
        p, T, hp = self.p, self.T, self.hp
        if self.ik:
            # ik stores K and V with ggml_cpy into a view of the cache (llama-build-context.cpp:906-960
            # llm_build_kv_store): no index inputs; rotates the cache only with -khad / -vhad (off by default,
            # :2264-2280); pads the mask's rows to GGML_KQ_MASK_PAD = 16 (:546-557)
            mask = Graph.input(f"kq_mask{tag}", (cells, -(-T // 16) * 16), "f16" if p.flash_attn else "f32")
            return {"k_idxs": None, "v_idxs": None, "mask": mask, "k_rot": None, "v_rot": None}
        k_idxs = Graph.input(f"k_idxs{tag}", (T,), "i64")
        v_idxs = None
        if with_v:
            n_v = hp.n_head_kv[0] * hp.head_dim_v
            v_idxs = Graph.input(f"v_idxs{tag}", (T,) if p.flash_attn else (T * n_v,), "i64")
        mask = Graph.input(f"kq_mask{tag}", (cells, T), "f16" if p.flash_attn else "f32")
        return {"k_idxs": k_idxs, "v_idxs": v_idxs, "mask": mask,
                "k_rot": self._rot(p.type_k, hp.head_dim_k, f"k_rot{tag}", largest=True) if with_v else None,
                "v_rot": self._rot(p.type_v, hp.head_dim_v, f"v_rot{tag}", largest=False) if with_v else None}

    @staticmethod
    def _rot(kv_type: str, head_dim: int, name: str, largest: bool) -> GT | None:
        if kv_type not in QUANT_KV or head_dim % 64:
            return None
        n = 64
        if largest:                    # K: the largest power of two (>= 64) dividing the head size
            while head_dim % (n * 2) == 0:
                n *= 2
        return Graph.input(name, (n, n), "f32")

    def out_ids(self) -> GT:
        return Graph.input("out_ids", (self.p.n_outputs,), "i32")

    # ---- attention (build_attn + build_attn_mha) ----

    def hadamard(self, x: GT, rot: GT) -> GT:
        g = self.g
        n = rot.ne[0]
        total = x.ne[0] * x.ne[1] * x.ne[2] * x.ne[3]
        r = g.reshape(x, (n, total // n)) if x.contig else g.cont(x, (n, total // n))
        r = g.mul_mat(rot, r, name="hadamard")
        return g.reshape(r, x.ne)

    def cache(self, il: int, kind: str, ne: tuple[int, ...], dtype: str) -> GT:
        return GT(f"cache_{kind}_l{il}", ne, dtype, ext=f"kv:{il}")

    def attn_mha(self, q: GT, k: GT, v: GT, mask: GT, sinks: GT | None, v_mla: GT | None, v_trans: bool) -> GT:
        g = self.g
        q = g.view(q, q.ne)
        q = g.permute(q, (0, 2, 1, 3))
        k = g.permute(k, (0, 2, 1, 3))
        v = g.permute(v, (0, 2, 1, 3))
        if self.p.flash_attn:
            if v_trans:
                v = g.transpose(v)
            if k.dtype == "f32":
                k = g.op("CPY", k.ne, "f16", k, name="k_f16")
            if v.dtype == "f32":
                v = g.op("CPY", v.ne, "f16", v, name="v_f16")
            cur = g.op("FLASH_ATTN_EXT", (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), "f32", q, k, v, mask, sinks,
                       name="fattn")
            if v_mla is not None:
                cur = g.permute(cur, (0, 2, 1, 3))
                cur = g.mul_mat(v_mla, cur, name="fattn_mla")
                cur = g.permute(cur, (0, 2, 1, 3))
                cur = g.cont(cur, name="fattn_cont")
            cur = g.reshape(cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
        elif (self.ik and 0 < self.p.amb < k.ne[1] * q.ne[1] * q.ne[2] * 4 // MiB and k.ne[2] == q.ne[2] == v.ne[2]
                and sinks is None and v_trans):
            # ik's llm_build_kqv with -amb below KQ's MiB and as many K/V heads as Q heads (llama-build-context.cpp
            # :2127, :2175-2218): one head at a time, the KQV of each concatenated to the last
            kqv = None
            for _ in range(q.ne[2]):
                kq_i = g.mul_mat(g.view(k, (k.ne[0], k.ne[1], 1)), g.view(q, (q.ne[0], q.ne[1], 1)), name="kq_i")
                kq_i = g.op("SOFT_MAX", kq_i.ne, "f32", kq_i, mask, name="kq_i_soft_max")
                kqv_i = g.mul_mat(g.view(v, (v.ne[0], v.ne[1], 1)), kq_i, name="kqv_i")
                kqv = kqv_i if kqv is None else g.op("CONCAT", (kqv.ne[0], kqv.ne[1], kqv.ne[2] + 1), "f32", kqv,
                                                      kqv_i, name="kqv")
            cur = g.permute(kqv, (0, 2, 1, 3))
            cur = g.cont(cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]), name="kqv_out")
        else:
            kq = g.mul_mat(k, q, name="kq")
            kq = g.op("SOFT_MAX", kq.ne, "f32", kq, mask, sinks, name="kq_soft_max")
            if not v_trans:
                v = g.cont(g.transpose(v), name="v_cont")
            kqv = g.mul_mat(v, kq, name="kqv")
            if v_mla is not None:
                kqv = g.mul_mat(v_mla, kqv, name="kqv_mla")
            cur = g.permute(kqv, (0, 2, 1, 3))
            cur = g.cont(cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]), name="kqv_out")
        g.expand(cur)
        return cur

    def attn_kv(self, il: int, inp: dict, q: GT, k: GT, v: GT, wo: GT, wo_b: GT | None, sinks: GT | None,
                cells: int, order: str) -> GT:
        """build_attn with a K+V cache (llama_kv_cache: order "qvk"; the iswa variant: "qkv")."""
        g, hp, p = self.g, self.hp, self.p
        if inp["k_rot"] is not None:
            q = self.hadamard(q, inp["k_rot"])
            k = self.hadamard(k, inp["k_rot"])
        if inp["v_rot"] is not None:
            v = self.hadamard(v, inp["v_rot"])
        for t in ({"q": q, "k": k, "v": v}[c] for c in order):
            g.expand(t)
        hkv, dk, dv = hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v
        v_trans = not p.flash_attn
        kc = self.cache(il, "k", (dk * hkv, cells), p.type_k)
        vc = self.cache(il, "v", (dv * hkv, cells), p.type_v)
        g.expand(g.set_rows(kc, g.view(k, (dk * hkv, self.T)), inp["k_idxs"]))
        if v_trans:
            vv = g.reshape(v, (1, dv * hkv * self.T))
        else:
            vv = g.view(v, (dv * hkv, self.T))
        g.expand(g.set_rows(vc, vv, inp["v_idxs"]))
        k_view = g.view(kc, (dk, hkv, cells, 1))
        v_view = g.view(vc, (cells, hkv, dv, 1) if v_trans else (dv, hkv, cells, 1))
        cur = self.attn_mha(q, k_view, v_view, inp["mask"], sinks, None, v_trans)
        if inp["v_rot"] is not None:
            cur = self.hadamard(cur, inp["v_rot"])
        return self.mm(wo, cur, wo_b, name="attn_out")

    def qkv(self, il: int, cur: GT) -> tuple[GT, GT, GT]:
        """build_qkv (separate Q/K/V weights, optional biases), reshaped to [head, n_head, T]."""
        g, hp, T = self.g, self.hp, self.T
        wqkv = self.lw(il, "attn_qkv.weight")
        if wqkv is not None:                  # fused QKV (build_qkv's wqkv path): one matmul, three views
            hkv = hp.n_head_kv[il]
            qkv = g.mul_mat(wqkv, cur, name="wqkv")
            bias = self.lw(il, "attn_qkv.bias")
            qb, kb, vb = (self.lw(il, f"attn_{x}.bias") for x in "qkv")
            if bias is None and qb is not None and kb is not None and vb is not None:
                bias = g.op("CONCAT", (qkv.ne[0],), "f32", g.op("CONCAT", (qb.ne[0] + kb.ne[0],), "f32", qb, kb), vb)
            if bias is not None:
                qkv = g.binary("ADD", qkv, bias, name="wqkv_b")
            return (g.view(qkv, (hp.head_dim_k, hp.n_head, T)), g.view(qkv, (hp.head_dim_k, hkv, T)),
                    g.view(qkv, (hp.head_dim_v, hkv, T)))
        if self.ik:
            # ik llm_build_mul_mat_qkv (llama-build-context.cpp:2322-2360): the three matmuls expanded first, in
            # the order Q, K, V, then their biases; mainline expands each of them with its norm and rope
            q, k, v = (g.expand(g.mul_mat(self.lw(il, f"attn_{x}.weight"), cur, name=f"{x.upper()}cur")) for x in "qkv")
            q, k, v = (t if b is None else g.expand(g.binary("ADD", t, b, name=t.name + "_b"))
                       for t, b in zip((q, k, v), (self.lw(il, f"attn_{x}.bias") for x in "qkv")))
        else:
            q = self.mm(self.lw(il, "attn_q.weight"), cur, self.lw(il, "attn_q.bias"), name="Qcur")
            k = self.mm(self.lw(il, "attn_k.weight"), cur, self.lw(il, "attn_k.bias"), name="Kcur")
            v = self.mm(self.lw(il, "attn_v.weight"), cur, self.lw(il, "attn_v.bias"), name="Vcur")
        hkv = hp.n_head_kv[il]
        return (g.reshape(q, (hp.head_dim_k, hp.n_head, T)), g.reshape(k, (hp.head_dim_k, hkv, T)),
                g.reshape(v, (hp.head_dim_v, hkv, T)))

    # ---- feed-forward (build_ffn, build_moe_ffn) ----

    def ffn(self, cur: GT, up: GT, gate: GT, down: GT) -> GT:
        """build_ffn with a parallel gate and SiLU: up, gate, swiglu(gate, up), down."""
        g = self.g
        if self.ik:
            if self.wtype(up) == self.wtype(gate) and self.wtype(up) not in NOT_QUANTIZED and up.ne == gate.ne:
                x = g.op(IK_GRAPH["fused_up_gate"], (up.ne[1], cur.ne[1]), "f32", up, gate, cur, name="ffn_up_gate")
            else:
                tmp = g.mul_mat(up, cur, name="ffn_up")
                x = g.mul_mat(gate, cur, name="ffn_gate")
                x = g.op("FUSED_MUL_UNARY", x.ne, "f32", x, tmp, name="ffn_gate_par")
            return g.mul_mat(down, x, name="ffn_down")
        tmp = g.mul_mat(up, cur, name="ffn_up")
        x = g.mul_mat(gate, cur, name="ffn_gate")
        x = g.binary("GLU", x, tmp, name="ffn_swiglu")
        return g.mul_mat(down, x, name="ffn_down")

    def moe(self, il: int, cur: GT, gating: str, norm_w: bool, probs_b: GT | None = None,
            biased: bool = False) -> GT:
        """build_moe_ffn: router, top-k, weights, up/gate/down per selected expert, weighted sum."""
        g, hp = self.g, self.hp
        E, T = cur.ne[0], cur.ne[1]
        X, A = hp.n_expert, hp.n_expert_used
        logits = g.mul_mat(self.lw(il, "ffn_gate_inp.weight"), cur, name="ffn_moe_logits")
        if biased and self.lw(il, "ffn_gate_inp.bias") is not None:
            logits = g.binary("ADD", logits, self.lw(il, "ffn_gate_inp.bias"), name="ffn_moe_logits_biased")
        if gating == "softmax":
            probs = g.unary("SOFT_MAX", logits, name="ffn_moe_probs")
        elif gating == "sigmoid":
            probs = g.unary("UNARY", logits, name="ffn_moe_probs")
        else:                                           # softmax_weight (gpt-oss): weights get the softmax
            probs = logits
        selection = probs
        if probs_b is not None:
            selection = g.binary("ADD", probs, probs_b, name="ffn_moe_probs_biased")
        argsort = g.op("ARGSORT", selection.ne, "i32", selection, name="ffn_moe_argsort")
        selected = g.view(argsort, (A, T))
        weights = g.get_rows(g.reshape(probs, (1, X, T)), selected, name="ffn_moe_weights")
        if gating == "softmax_weight":
            weights = g.unary("SOFT_MAX", g.reshape(weights, (A, T)), name="ffn_moe_weights_softmax")
            weights = g.reshape(weights, (1, A, T))
        if norm_w:
            w2 = g.reshape(weights, (A, T))
            total = g.op("SUM_ROWS", (1, T), "f32", w2, name="ffn_moe_weights_sum")
            if not self.ik:                   # ik clamps only for LAGUNA (llama-build-context.cpp:1545-1547)
                total = g.unary("CLAMP", total, name="ffn_moe_weights_sum_clamped")
            weights = g.binary("DIV", w2, total, name="ffn_moe_weights_norm")
            weights = g.reshape(weights, (1, A, T))
        g.expand(weights)
        x = g.reshape(cur, (E, 1, T))
        if self.ik:
            return self._moe_experts_ik(il, x, selected, weights, gating == "softmax_weight", biased)
        gate_up_w = self.lw(il, "ffn_gate_up_exps.weight")
        if gate_up_w is not None:             # fused gate+up experts: one mul_mat_id, then two views
            gate_up = g.mul_mat_id(gate_up_w, x, selected, name="ffn_moe_gate_up")
            half = (gate_up.ne[0] // 2, gate_up.ne[1], gate_up.ne[2])
            gate, up = g.view(gate_up, half), g.view(gate_up, half)
        else:
            up = g.mul_mat_id(self.lw(il, "ffn_up_exps.weight"), x, selected, name="ffn_moe_up")
            if biased:
                up = g.binary("ADD_ID", up, self.lw(il, "ffn_up_exps.bias"), selected, name="ffn_moe_up_biased")
            gate = g.mul_mat_id(self.lw(il, "ffn_gate_exps.weight"), x, selected, name="ffn_moe_gate")
            if biased:
                gate = g.binary("ADD_ID", gate, self.lw(il, "ffn_gate_exps.bias"), selected,
                                name="ffn_moe_gate_biased")
        act = g.binary("GLU", gate, up, name="ffn_moe_swiglu")
        experts = g.mul_mat_id(self.lw(il, "ffn_down_exps.weight"), act, selected, name="ffn_moe_down")
        if biased:
            experts = g.binary("ADD_ID", experts, self.lw(il, "ffn_down_exps.bias"), selected,
                               name="ffn_moe_down_biased")
        experts = g.binary("MUL", experts, weights, name="ffn_moe_weighted")
        g.expand(experts)
        views = [g.view(experts, (E, T)) for _ in range(A)]
        for v in views:
            g.expand(v)
        out = views[0]
        for v in views[1:]:
            out = g.binary("ADD", out, v, name="ffn_moe_add")
            g.expand(out)
        if A == 1:
            out = g.cont(out, name="ffn_moe_out")
        return out

    def _moe_experts_ik(self, il: int, x: GT, selected: GT, weights: GT, oai: bool, biased: bool) -> GT:
        """ik's llm_build_moe_ffn from the experts on (llama-build-context.cpp:1573-1690): the fused up/gate, the
        down projection, the fused weighted sum. Its graph does not depend on where the experts live: the same
        ops whether they sit in VRAM or in RAM (op offload then runs them on the GPU, or the CPU runs them)."""
        g, lw, T = self.g, functools.partial(self.lw, il), x.ne[2]
        A = selected.ne[0]

        def bias(name: str) -> GT | None:
            return lw(name) if biased else None
        up_w, gate_w, gate_up_w = lw("ffn_up_exps.weight"), lw("ffn_gate_exps.weight"), lw("ffn_gate_up_exps.weight")
        if gate_up_w is not None:             # :1583-1595: a merged tensor is always fused, each half one result
            par = g.op(IK_GRAPH["fused_moe_up_gate"], (gate_up_w.ne[1] // 2, A, T), "f32", gate_up_w, None, x,
                       selected, bias("ffn_gate_up_exps.bias"), name="ffn_moe_gate_par")
        elif self.p.fmoe and self.wtype(up_w) == self.wtype(gate_w):   # :1598-1609
            par = g.op(IK_GRAPH["fused_moe_up_gate"], (up_w.ne[1], A, T), "f32", up_w, gate_w, x, selected,
                       bias("ffn_up_exps.bias"), bias("ffn_gate_exps.bias"), name="ffn_moe_gate_par")
        else:                                 # :1610-1644: both results kept until the fused activation
            up = g.expand(g.mul_mat_id(up_w, x, selected, name="ffn_moe_up"))
            gate = g.expand(g.mul_mat_id(gate_w, x, selected, name="ffn_moe_gate"))
            if biased:
                up = g.binary("ADD_ID", up, bias("ffn_up_exps.bias"), selected, name="ffn_moe_up_biased")
                gate = g.binary("ADD_ID", gate, bias("ffn_gate_exps.bias"), selected, name="ffn_moe_gate_biased")
            # gpt-oss: ggml_swiglu_oai, a UNARY (ggml.c:7295); otherwise FUSED_MUL_UNARY (ggml.c:6621)
            par = g.binary("UNARY" if oai else "FUSED_MUL_UNARY", gate, up, name="ffn_moe_gate_par")
        experts = g.mul_mat_id(self.lw(il, "ffn_down_exps.weight"), par, selected, name="ffn_moe_down")
        if biased:
            experts = g.binary("ADD_ID", experts, bias("ffn_down_exps.bias"), selected, name="ffn_moe_down_biased")
        # :1668-1678 (fused_mmad): [n_embd, T] straight from the experts and their weights
        return g.op(IK_GRAPH["fused_mmad"], (experts.ne[0], T), "f32", experts, weights, name="ffn_moe_weighted")

    # ---- the output (result_norm, result_output) ----

    def output(self, cur: GT) -> None:
        g = self.g
        cur = self.norm(cur, self.w("output_norm.weight"), name="result_norm")
        self.output_flag(cur)                   # res->t_embd
        out_w = self.w("output.weight")
        if out_w is None:                       # tied: token_embd loaded again as the output, on its device
            emb = self.inv.by_name["token_embd.weight"]
            out_w = Graph.weight("token_embd.weight", emb.shape, emb.nbytes, ext=TIED_OUTPUT)
        logits = g.mul_mat(out_w, cur, name="result_output")
        self.output_flag(logits)                # res->t_logits
        g.expand(logits)

    # ---- architectures (src/models/*.cpp) ----

    def build(self) -> Graph:
        arch = self.hp.arch
        fn = {"llama": self._standard, "qwen2": self._standard, "qwen3": self._standard,
              "qwen3moe": self._standard, "qwen2moe": self._standard, "glm4moe": self._standard,
              "gpt-oss": self._gptoss, "deepseek2": self._deepseek2}.get(arch)
        if fn is None:
            fn = self._standard                 # llama-like fallback (llama4 ... share the skeleton)
        fn()
        return self.g

    def _n_main(self) -> int:
        return self.hp.n_layer - self.hp.n_nextn

    def _layers(self) -> tuple[int, ...]:
        return self.p.layers if self.p.layers is not None else tuple(range(self._n_main()))

    def _standard(self) -> None:
        """llama / qwen2 / qwen3 / qwen3moe / qwen2moe / glm4moe: norm, attention, residual, (MoE) FFN."""
        g, hp, arch = self.g, self.hp, self.hp.arch
        self.inputs()
        inp = self.kv_inputs(self.p.kv_cells[0] if self.p.kv_cells else 0, "")
        out_ids = self.out_ids()
        inpL = self.inpL
        n = self._n_main()
        for il in self._layers():
            inpSA = inpL
            cur = self.norm(inpL, self.lw(il, "attn_norm.weight"), name="attn_norm")
            q, k, v = self.qkv(il, cur)
            qn, kn = self.lw(il, "attn_q_norm.weight"), self.lw(il, "attn_k_norm.weight")
            if qn is not None:
                q = self.norm(q, qn, name="Qcur_normed")
            q = g.unary("ROPE", q, self.pos, name="Qcur_rope")
            if kn is not None:
                k = self.norm(k, kn, name="Kcur_normed")
            k = g.unary("ROPE", k, self.pos, name="Kcur_rope")
            # llama_kv_cache's build_attn expands q, v, k; ik's llm_build_kv q, k, v (llama-build-context.cpp:2282-2288)
            cur = self.attn_kv(il, inp, q, k, v, self.lw(il, "attn_output.weight"), self.lw(il, "attn_output.bias"),
                               None, self.p.kv_cells[il], "qkv" if self.ik else "qvk")
            if il == n - 1:
                cur = g.get_rows(cur, out_ids, name="attn_out_rows")
                inpSA = g.get_rows(inpSA, out_ids, name="inpSA_rows")
            ffn_inp = g.binary("ADD", cur, inpSA, name="ffn_inp")
            post = "post_attention_norm.weight" if arch == "glm4moe" else "ffn_norm.weight"
            cur = self.norm(ffn_inp, self.lw(il, post), name="ffn_norm")
            moe = hp.moe_layers[il] if il < len(hp.moe_layers) else False
            if not moe:
                cur = self.ffn(cur, self.lw(il, "ffn_up.weight"), self.lw(il, "ffn_gate.weight"),
                               self.lw(il, "ffn_down.weight"))
            elif arch == "qwen2moe":
                moe_out = self.moe(il, cur, "softmax", norm_w=False)
                gate_inp = g.mul_mat(self.lw(il, "ffn_gate_inp_shexp.weight"), cur, name="ffn_shexp_gate_inp")
                silu = g.unary("UNARY", gate_inp, name="ffn_shexp_silu")
                gate = g.binary("DIV", silu, gate_inp, name="ffn_shexp_gate")
                sh = self.ffn(cur, self.lw(il, "ffn_up_shexp.weight"), self.lw(il, "ffn_gate_shexp.weight"),
                              self.lw(il, "ffn_down_shexp.weight"))
                sh = g.binary("MUL", sh, gate, name="ffn_shexp_out")
                cur = g.binary("ADD", moe_out, sh, name="ffn_out")
            elif arch == "glm4moe":
                moe_out = self.moe(il, cur, "sigmoid", norm_w=True, probs_b=self.lw(il, "exp_probs_b.bias"))
                sh = self.ffn(cur, self.lw(il, "ffn_up_shexp.weight"), self.lw(il, "ffn_gate_shexp.weight"),
                              self.lw(il, "ffn_down_shexp.weight"))
                cur = g.binary("ADD", moe_out, sh, name="ffn_out")
            else:                               # qwen3moe, llama (MoE branch): softmax, normalized weights
                cur = self.moe(il, cur, "softmax", norm_w=True)
            cur = g.binary("ADD", cur, ffn_inp, name="l_out")
            inpL = cur
        self.output(inpL)

    def _gptoss(self) -> None:
        """openai-moe.cpp: iswa cache, attention biases and sinks, MoE with biases and softmax-weight gating;
        the last layer runs on every token and its output (t_h_nextn) is kept; out_ids select afterwards."""
        g, hp, p = self.g, self.hp, self.p
        self.inputs()
        base = self.kv_inputs(p.base_cells, "")
        swa = self.kv_inputs(p.swa_cells, "_swa")
        out_ids = self.out_ids()
        inpL = self.inpL
        for il in self._layers():
            is_swa = hp.swa_layers[il] if il < len(hp.swa_layers) else False
            inpSA = inpL
            cur = self.norm(inpL, self.lw(il, "attn_norm.weight"), name="attn_norm")
            q, k, v = self.qkv(il, cur)
            q = g.unary("ROPE", q, self.pos, name="Qcur_rope")
            k = g.unary("ROPE", k, self.pos, name="Kcur_rope")
            cur = self.attn_kv(il, swa if is_swa else base, q, k, v, self.lw(il, "attn_output.weight"),
                               self.lw(il, "attn_output.bias"), self.lw(il, "attn_sinks.weight"),
                               p.kv_cells[il], "qkv")
            ffn_inp = g.binary("ADD", cur, inpSA, name="ffn_inp")
            cur = self.norm(ffn_inp, self.lw(il, "post_attention_norm.weight"), name="attn_post_norm")
            cur = self.moe(il, cur, "softmax_weight", norm_w=False, biased=True)
            cur = g.binary("ADD", cur, ffn_inp, name="l_out")
            inpL = cur
        self.output_flag(inpL)                  # res->t_h_nextn
        self.output(g.get_rows(inpL, out_ids, name="out_rows"))

    def _deepseek2(self) -> None:
        """deepseek2.cpp with MLA (absorbed attention over a K-only latent cache) and dense leading layers."""
        g, hp, p = self.g, self.hp, self.p
        self.inputs()
        inp = self.kv_inputs(p.kv_cells[0] if p.kv_cells else 0, "", with_v=False)
        out_ids = self.out_ids()
        inpL = self.inpL
        n = self._n_main()
        for il in self._layers():
            inpSA = inpL
            cur = self.norm(inpL, self.lw(il, "attn_norm.weight"), name="attn_norm")
            cur = self._mla_ik(il, cur, inp) if self.ik else self._mla(il, cur, inp)
            if il == n - 1:
                cur = g.get_rows(cur, out_ids, name="attn_out_rows")
                inpSA = g.get_rows(inpSA, out_ids, name="inpSA_rows")
            ffn_inp = g.binary("ADD", cur, inpSA, name="ffn_inp")
            cur = self.norm(ffn_inp, self.lw(il, "ffn_norm.weight"), name="ffn_norm")
            if not (hp.moe_layers[il] if il < len(hp.moe_layers) else False):
                cur = self.ffn(cur, self.lw(il, "ffn_up.weight"), self.lw(il, "ffn_gate.weight"),
                               self.lw(il, "ffn_down.weight"))
            else:
                probs_b = self.lw(il, "exp_probs_b.bias")
                gating = "sigmoid" if probs_b is not None else "softmax"
                moe_out = self.moe(il, cur, gating, norm_w=True, probs_b=probs_b)
                sh = self.ffn(cur, self.lw(il, "ffn_up_shexp.weight"), self.lw(il, "ffn_gate_shexp.weight"),
                              self.lw(il, "ffn_down_shexp.weight"))
                cur = g.binary("ADD", moe_out, sh, name="ffn_out")
            cur = g.binary("ADD", cur, ffn_inp, name="l_out")
            inpL = cur
        self.output(inpL)


def build_graph(inv: ModelInventory, params: GraphParams) -> Graph:
    """The graph llama.cpp reserves for one ubatch of params.n_tokens tokens."""
    return _Builder(inv, params).build()
