"""DeepSeek's multi-head latent attention (MLA) in the compute graph: mainline's (deepseek2.cpp: q absorbed into the
latent, one K-only cache) and ik_llama.cpp's own graph for each -mla and -amb. A mixin of llama_graph's builder,
which supplies the graph (`g`), the model's hyperparameters (`hp`), the GraphParams (`p`), the ubatch (`T`) and the
shared pieces it calls (`lw`, `norm`, `cache`, `attn_kv`, `attn_mha`, ...); kept apart because ik's MLA alone is four
graphs (the prompt path, the latent flash attention, KQ over the latent, the -amb split) that no other model uses.
"""
from __future__ import annotations

import functools

from .ggml_graph import GT, Graph
from .ggml_types import by_name
from .hardware import MiB

# ik_llama.cpp 8337e4cd's MLA attention (src/graphs/build_deepseek2.cpp build_deepseek2_layer_attention :720-1233),
# which replaces mainline's for -mla 1/2/3. Which graph a layer gets:
# - -mla 2/3 with flash attention and a batch of >= pp_opt_min_tokens: the prompt path (:922-1024), K and V of
#   every head decompressed from the latent by wkv_b, in groups of heads that -amb bounds;
# - -mla 1/3 with flash attention otherwise: flash attention over the latent cache itself (:1043-1076);
# - no flash attention (and -mla 2 with it below pp_opt_min_tokens): KQ, softmax, KQV over the latent (:1077-1144),
#   split into groups of heads when KQ exceeds -amb MiB.
IK_MLA: dict[str, int] = {
    "pp_opt_min_tokens": 128,       # :1299 pp_opt = n_tokens >= 128 && mla_attn > 1
}


class MlaAttention:
    """The MLA attention of one layer, mainline's (`_mla`) or ik's (`_mla_ik`); see the module docstring."""

    def _mla(self, il: int, cur: GT, inp: dict) -> GT:
        """deepseek2.cpp's attention: q absorbed into the latent (wk_b), one K-only cache, V a view of it, wv_b after
        the attention (build_attn_mha's v_mla)."""
        g, hp, p, T = self.g, self.hp, self.p, self.T
        kvl, rope, H = hp.mla_kv_lora_rank, hp.n_rot, hp.n_head
        if self.lw(il, "attn_q_a.weight") is not None:
            q = g.mul_mat(self.lw(il, "attn_q_a.weight"), cur, name="q_a")
            q = self.norm(q, self.lw(il, "attn_q_a_norm.weight"), name="q_a_norm")
            q = g.mul_mat(self.lw(il, "attn_q_b.weight"), q, name="q_b")
        else:
            q = g.mul_mat(self.lw(il, "attn_q.weight"), cur, name="q")
        dk = q.ne[0] // H
        q = g.reshape(q, (dk, H, T))
        kv_pe = g.mul_mat(self.lw(il, "attn_kv_a_mqa.weight"), cur, name="kv_cmpr_pe")
        kv_cmpr = g.view(kv_pe, (kvl, T))
        k_pe = g.view(kv_pe, (rope, 1, T))
        k_pe = g.unary("ROPE", k_pe, self.pos, name="k_pe")
        kv_cmpr = self.norm(kv_cmpr, self.lw(il, "attn_kv_a_norm.weight"), name="kv_cmpr")
        nope = dk - rope
        q_nope = g.view(q, (nope, H, T))
        q_pe = g.view(q, (rope, H, T))
        q_pe = g.unary("ROPE", q_pe, self.pos, name="q_pe")
        q_nope = g.permute(q_nope, (0, 2, 1, 3))
        q_abs = g.mul_mat(self.lw(il, "attn_k_b.weight"), q_nope, name="q_nope_absorbed")
        q_abs = g.permute(q_abs, (0, 2, 1, 3))
        qcur = g.op("CONCAT", (kvl + rope, H, T), "f32", q_abs, q_pe, name="Qcur")
        kv_cmpr = g.reshape(kv_cmpr, (kvl, 1, T))
        kcur = g.op("CONCAT", (kvl + rope, 1, T), "f32", kv_cmpr, k_pe, name="Kcur")
        vcur = kv_cmpr
        # build_attn(llm_graph_input_attn_k): q, v, k expanded; store K; V is a view of the K cache
        for t in (qcur, vcur, kcur):
            g.expand(t)
        cells = p.kv_cells[il]
        kc = self.cache(il, "k", (kvl + rope, cells), p.type_k)
        g.expand(g.set_rows(kc, g.view(kcur, (kvl + rope, T)), inp["k_idxs"]))
        k_view = g.view(kc, (kvl + rope, 1, cells, 1))
        v_view = g.view(kc, (kvl, 1, cells, 1))
        cur = self.attn_mha(qcur, k_view, v_view, inp["mask"], None, self.lw(il, "attn_v_b.weight"),
                            v_trans=False)
        cur = g.mul_mat(self.lw(il, "attn_output.weight"), cur, name="attn_out")
        return cur

    @staticmethod
    def _wview(w: GT, ne: tuple[int, ...], op: str = "VIEW") -> GT:
        """A view (or reshape) of a weight: a node of the graph, nothing allocated; its bytes are the weight's
        share (what the scheduler would copy to another device)."""
        n = ne[0] * (ne[1] if len(ne) > 1 else 1) * (ne[2] if len(ne) > 2 else 1)
        return GT(w.name + "(v)", ne, w.dtype, op, (w,), view_src=w, contig=op == "RESHAPE",
                  nbytes=w.nbytes * n // (w.ne[0] * w.ne[1] * w.ne[2] * w.ne[3]))

    def _wk_b(self, il: int, H: int) -> tuple[GT, GT]:
        """wk_b [nope, kv_lora_rank, n_head] and wv_b [kv_lora_rank, v, n_head]; ik's own GGUFs keep them 2-D
        ([nope, n_head * kv_lora_rank], [kv_lora_rank, n_head * v]) and the graph reshapes them (:1030-1031,
        :1146-1150)."""
        wk_b, wv_b = self.lw(il, "attn_k_b.weight"), self.lw(il, "attn_v_b.weight")
        if wk_b.ne[2] == 1 and H > 1:
            wk_b = self._wview(wk_b, (wk_b.ne[0], wk_b.ne[1] // H, H), "RESHAPE")
        if wv_b.ne[2] == 1 and H > 1:
            wv_b = self._wview(wv_b, (wv_b.ne[0], wv_b.ne[1] // H, H), "RESHAPE")
        return wk_b, wv_b

    def _wkv_b(self, il: int, wk_b: GT, wv_b: GT) -> GT:
        """wkv_b [kv_lora_rank, n_head * (nope + v)]: the GGUF's attn_kv_b, or the one ik computes at load from
        wk_b and wv_b for -mla 0/2/3 (src/llama.cpp:3412-3470, llm_compute_wkv_b :2892-2973: F16 or BF16 when both
        are, Q8_0 otherwise) and stores in wk_b's buffer type, so it lives where wk_b does."""
        w = self.lw(il, "attn_kv_b.weight")
        if w is not None:
            return w
        kvl, nope, H = wk_b.ne[1], wk_b.ne[0], wk_b.ne[2]
        rows = H * (nope + wv_b.ne[1])
        k_name = f"blk.{il}.attn_k_b.weight"
        types = {self.inv.by_name[k_name].ggml_type, self.inv.by_name[f"blk.{il}.attn_v_b.weight"].ggml_type}
        t = types.pop() if len(types) == 1 and types <= {"F16", "BF16"} else "Q8_0"
        return Graph.weight(f"blk.{il}.attn_kv_b.weight", (kvl, rows), rows * by_name(t).row_bytes(kvl), ext=k_name)

    def _mla_ik(self, il: int, cur: GT, inp: dict) -> GT:
        """ik's build_deepseek2_layer_attention (src/graphs/build_deepseek2.cpp:720-1233) for -mla 0/1/2/3 on a
        K-only latent cache (IK_MLA). Returns the attention output after wo."""
        g, hp, p, T, lw = self.g, self.hp, self.p, self.T, functools.partial(self.lw, il)
        kvl, rope, H, mla, fa = hp.mla_kv_lora_rank, hp.n_rot, hp.n_head, p.mla, p.flash_attn
        # :787-795 (V2-Lite :836-842): the q and compressed-kv matmuls expanded first, then q's norm and q_b
        if lw("attn_q_a.weight") is not None:
            q = g.mul_mat(lw("attn_q_a.weight"), cur, name="q")
            kv_rope_c = g.mul_mat(lw("attn_kv_a_mqa.weight"), cur, name="kv_rope_compressed")
            g.expand(q)
            g.expand(kv_rope_c)
            q = self.norm(q, lw("attn_q_a_norm.weight"), name="q_a_norm")
            q = g.mul_mat(lw("attn_q_b.weight"), q, name="q_b")
        else:                                  # V2-Lite: no q_lora
            q = g.mul_mat(lw("attn_q.weight"), cur, name="q")
            kv_rope_c = g.mul_mat(lw("attn_kv_a_mqa.weight"), cur, name="kv_rope_compressed")
            g.expand(q)
            g.expand(kv_rope_c)
        dk = q.ne[0] // H
        nope = dk - rope
        q_nope = g.view(q, (nope, H, T))
        q_rope = g.expand(g.view(q, (rope, H, T)))
        k_rope = g.expand(g.view(kv_rope_c, (rope, 1, T)))
        kv_c = g.view(kv_rope_c, (kvl, T))
        q_rope = g.expand(g.unary("ROPE", q_rope, self.pos, name="q_rope"))     # :866-881
        k_rope = g.expand(g.unary("ROPE", k_rope, self.pos, name="k_rope"))
        kv_c = self.norm(kv_c, lw("attn_kv_a_norm.weight"), name="kv_compressed")
        wk_b, wv_b = self._wk_b(il, H)
        if mla == 0:
            return self._mla_ik_off(il, q_nope, q_rope, k_rope, kv_c, inp["mask"], dk, wk_b, wv_b)
        # the cache: c^KV rows of rope + kv_lora_rank (the K type, or without flash attention at -mla 2/3 the V
        # type, src/llama.cpp:1420-1427); -mla 1 without flash attention also kv^T, kv_lora_rank x cells (:1437-1441)
        cells = p.kv_cells[il]
        ktype = p.type_k if fa or mla == 1 else p.type_v
        kc = self.cache(il, "k", (kvl + rope, cells), ktype)
        kv_trans = None
        if mla == 1 and not fa:                # :890-903: the transposed c^KV stored first
            vc = self.cache(il, "v", (kvl * cells,), p.type_v)
            g.expand(g.cpy(g.transpose(kv_c), g.view(vc, (T, kvl))))
            kv_trans = g.view(vc, (cells, kvl))
        kvr = g.op("CONCAT", (rope + kvl, T), "f32", g.permute(k_rope, (0, 2, 1, 3)), kv_c, name="kvr")
        g.expand(g.cpy(kvr, g.view(kc, (kvl + rope, T))))                           # :905-914
        kv_cache = g.view(kc, (kvl + rope, cells))
        pp_opt = mla > 1 and IK_MLA["pp_opt_min_tokens"] <= T
        if mla > 1 and fa and pp_opt:
            cur = self._mla_ik_wkv_b(il, q_nope, q_rope, kc, ktype, inp["mask"], dk, wk_b, wv_b)
        else:
            # :1030-1041: q_nope absorbed into the latent by wk_b, q = [rope + kv_lora_rank, T, n_head]
            q_nope2 = g.mul_mat(wk_b, g.permute(q_nope, (0, 2, 1, 3)), name="q_nope2")
            q = g.op("CONCAT", (rope + kvl, T, H), "f32", g.permute(q_rope, (0, 2, 1, 3)), q_nope2, name="q")
            if fa and mla in (1, 3):           # :1043-1076: attention over the latent, V its kv_lora_rank part
                kv_lora = g.view(kc, (kvl, cells))
                kqv_c = g.op("FLASH_ATTN_EXT", (kvl, H, T), "f32", q, kv_cache, kv_lora, inp["mask"],
                             name="kqv_compressed")
                kqv_c = g.permute(kqv_c, (0, 2, 1, 3))
            else:
                if mla > 1:                    # :1078-1087: the latent transposed into the compute buffer
                    kv_trans = g.cont(g.transpose(g.view(kc, (kvl, cells))), name="kv_cache_trans")
                kqv_c = self._mla_ik_kq(q, kv_cache, kv_trans, inp["mask"], pp_opt)
            kqv = g.mul_mat(wv_b, kqv_c, name="kqv")                                # :1146-1167
            if T > 1:
                kqv = g.cont(g.permute(kqv, (0, 2, 1, 3)), name="kqv_perm")
            cur = g.reshape(kqv, (kqv.ne[0] * kqv.ne[1], T))
        g.expand(cur)
        return g.mul_mat(lw("attn_output.weight"), cur, name="kqv_out")

    def _mla_ik_off(self, il: int, q_nope: GT, q_rope: GT, k_rope: GT, kv_c: GT, mask: GT, dk: int, wk_b: GT,
                    wv_b: GT) -> GT:
        """ik's -mla 0 (:1181-1230): K and V of every head decompressed by wkv_b before the cache, which then holds
        them in full (n_head heads of dk and v), and llm_build_kv's attention over it (llama-build-context.cpp
        :2243-2303 -> llm_build_kqv :1981-2238)."""
        g, hp, p, T = self.g, self.hp, self.p, self.T
        H, rope, cells = hp.n_head, hp.n_rot, p.kv_cells[il]
        nope = dk - rope
        kv = g.mul_mat(self._wkv_b(il, wk_b, wv_b), kv_c, name="kv")
        dv = kv.ne[0] // H - nope
        k_nope = g.view(kv, (nope, H, T))
        v = g.reshape(g.cont(g.view(kv, (dv, H, T)), name="v_states"), (dv * H, T))
        q = g.op("CONCAT", (dk, H, T), "f32", q_nope, q_rope, name="q_states")
        k_rep = g.op("REPEAT", (rope, H, T), "f32", k_rope, name="k_rope_rep")
        k = g.op("CONCAT", (dk, H, T), "f32", k_nope, k_rep, name="k_states")
        for t in (q, k, v):                    # :2282-2288
            g.expand(t)
        kc = self.cache(il, "k", (dk * H, cells), p.type_k)
        vc = self.cache(il, "v", (dv * H, cells), p.type_v)
        g.expand(g.cpy(k, g.view(kc, (dk, T * H))))                                  # :906-960
        if p.flash_attn:
            g.expand(g.cpy(v, g.view(vc, (dv * H * T,))))
        else:                                  # the transposed V cache of the non-FA layout
            g.expand(g.cpy(g.transpose(v), g.view(vc, (T, dv * H))))
        q = g.permute(q, (0, 2, 1, 3))                                                # :2013
        k = g.view(kc, (dk, cells, H))
        if p.flash_attn:                       # :2070-2104
            cur = g.op("FLASH_ATTN_EXT", (dv, H, T), "f32", q, k, g.view(vc, (dv, cells, H)), mask, name="fa")
            cur = g.reshape(cur, (dv * H, T))
        else:                                  # :2106-2218, V transposed in the cache
            vt = g.view(vc, (cells, dv, H))
            kq_size = cells * T * H * 4 // MiB
            if p.amb == 0 or p.amb >= kq_size:
                kq = g.mul_mat(k, q, name="kq")
                kq = g.op("SOFT_MAX", kq.ne, "f32", kq, mask, name="kq_soft_max_ext")
                kqv = g.mul_mat(vt, kq, name="kqv")
            else:                              # :2175-2218: one head at a time
                kqv = None
                for _ in range(H):
                    kq_i = g.mul_mat(g.view(k, (dk, cells, 1)), g.view(q, (dk, T, 1)), name="kq_i")
                    kq_i = g.op("SOFT_MAX", kq_i.ne, "f32", kq_i, mask, name="kq_i_soft_max")
                    kqv_i = g.mul_mat(g.view(vt, (cells, dv, 1)), kq_i, name="kqv_i")
                    kqv = kqv_i if kqv is None else g.op("CONCAT", (dv, T, kqv.ne[2] + 1), "f32", kqv, kqv_i,
                                                          name="kqv")
            cur = g.cont(g.permute(kqv, (0, 2, 1, 3)), (dv * H, T), name="kqv_merged_cont")
        g.expand(cur)
        return g.mul_mat(self.lw(il, "attn_output.weight"), cur, name="kqv_out")

    def _mla_ik_kq(self, q: GT, kv_cache: GT, kv_trans: GT, mask: GT, pp_opt: bool) -> GT:
        """ik's attention without flash attention over the latent (:1089-1144): KQ, softmax, KQV; -amb splits it
        into groups of heads when KQ would exceed attn_max_batch MiB. Returns KQV as [kv_lora_rank, T, n_head]."""
        g, p = self.g, self.p
        cells, T, H = kv_cache.ne[1], q.ne[1], q.ne[2]
        kq_size = cells * T * H * 4 // MiB
        if p.amb <= 0 or p.amb >= kq_size:
            if not pp_opt:
                q = g.permute(q, (0, 2, 1, 3))
            kq = g.mul_mat(kv_cache, q, name="kq")
            if not pp_opt:
                kq = g.cont(g.permute(kq, (0, 2, 1, 3)), name="kq_perm")
            kq = g.op("SOFT_MAX", kq.ne, "f32", kq, mask, name="kq_soft_max_ext")
            if not pp_opt:
                kq = g.permute(kq, (0, 2, 1, 3))
            kqv = g.mul_mat(kv_trans, kq, name="kqv_compressed")
            return kqv if pp_opt else g.permute(kqv, (0, 2, 1, 3))
        n_step = min(-(-kq_size // p.amb), H)
        n_per_step = -(-H // n_step)
        kqv = None
        for i_head in range(0, H, n_per_step):
            q_i = g.view(q, (q.ne[0], T, min(n_per_step, H - i_head)))
            kq_i = g.mul_mat(kv_cache, q_i, name="kq_i")
            kq_i = g.op("SOFT_MAX", kq_i.ne, "f32", kq_i, mask, name="kq_i_soft_max")
            kqv_i = g.mul_mat(kv_trans, kq_i, name="kqv_i")
            kqv = kqv_i if kqv is None else g.op("CONCAT", (kqv.ne[0], T, kqv.ne[2] + kqv_i.ne[2]), "f32", kqv,
                                                  kqv_i, name="kqv_compressed")
            g.expand(kqv)
        return kqv

    def _mla_ik_wkv_b(self, il: int, q_nope: GT, q_rope: GT, kc: GT, ktype: str, mask: GT, dk: int, wk_b: GT,
                      wv_b: GT) -> GT:
        """ik's prompt path for -mla 2/3 with flash attention (:922-1024): K and V of every head decompressed from
        the latent by wkv_b into the compute buffer, in groups of heads small enough for -amb, each group's
        attention concatenated to the last. Returns [v * n_head, T]."""
        g, hp, p, T = self.g, self.hp, self.p, self.T
        kvl, rope, H, cells, nope = hp.mla_kv_lora_rank, hp.n_rot, hp.n_head, kc.ne[1], dk - hp.n_rot
        wkv_b = self._wkv_b(il, wk_b, wv_b)
        kv_nope = g.view(kc, (kvl, cells))
        kv_f32_size = wkv_b.ne[1] * cells * 4 // MiB
        n_max_head = H
        if p.amb > 0 and kv_f32_size > p.amb:
            n_max_head = next((H // n for n in range(2, H) if H % n == 0 and kv_f32_size // n <= p.amb), 1)
        n_per_head = wkv_b.ne[1] // H
        dv = n_per_head - nope
        # :942-960: the cache's rope part repeated over the group's heads, in the cache type on a CPU-only build,
        # in F16 on a GPU build (a quantized cache is cast first)
        kv_type = "f16" if p.gpu_build else ktype
        kv_rope = g.view(kc, (rope, cells, 1))
        if ktype != kv_type:
            kv_rope = g.cast(kv_rope, kv_type, name="kv_cache_rope_f16")
        k_rope = g.op("REPEAT", (rope, cells, n_max_head), kv_type, kv_rope, name="k_rope_rep")
        q = g.op("CONCAT", (dk, H, T), "f32", q_rope, q_nope, name="q_concat")
        q = g.expand(g.permute(q, (0, 2, 1, 3)))
        cur = None
        for _ in range(H // n_max_head):
            rows = n_per_head * n_max_head
            kv_f32 = g.mul_mat(self._wview(wkv_b, (kvl, rows)), kv_nope, name="kv_f32")
            v = g.cast(g.view(kv_f32, (dv, cells, n_max_head)), kv_type, name="v")
            k_nope = g.cast(g.view(kv_f32, (nope, cells, n_max_head)), kv_type, name="k_nope")
            g.expand(k_nope)
            g.expand(v)
            k = g.expand(g.op("CONCAT", (dk, cells, n_max_head), kv_type, k_rope, k_nope, name="k"))
            kqv = g.op("FLASH_ATTN_EXT", (dv, n_max_head, T), "f32", g.view(q, (dk, T, n_max_head)), k, v,
                       mask, name="kqv")
            kqv = g.reshape(kqv, (dv * n_max_head, T))
            cur = kqv if cur is None else g.op("CONCAT", (cur.ne[0] + kqv.ne[0], T), "f32", cur, kqv, name="kqv_cat")
            g.expand(cur)
        return cur
