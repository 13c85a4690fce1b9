"""ik_llama.cpp's CUDA memory pool: the temporaries of its flash attention and MoE ops, which grow with the ubatch
and appear in no buffer line ik logs (memory.py adds them to each GPU's total as DeviceMemory.pool).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from collections.abc import Sequence

from .hardware import MiB, HardwareProfile
from .model import ModelInventory, Tensor
from .plan import Plan, device_sort_key, gpu_index
from .residency import home_devices, kv_cells, offload_min_batch

# Kernels take their temporaries from a per-device pool that no buffer line logs (ik 8337e4cd ggml-cuda.cu:426-521:
# on a GPU with virtual memory management it maps physical memory in granularity steps as the high-water mark of its
# stack rises, and never unmaps it). Requests are freed in reverse order within the op that made them, so the pool
# ends as large as the largest set of temporaries one op held at once, over every op and batch the device ran.
# Two kinds of op set it:
#
# - flash attention (GQA models): sized in launch_fattn_mma (ggml-cuda/fattn-mma-f16.cuh:1269-1432): F16 copies of
#   K and V unless the cache is F16, the KV_min_max table from 1024 tokens, and dst_tmp_meta. That last one is
#   allocated as blocks * ncols * (4 + D) * sizeof(float) elements of float2 (fattn-mma-f16.cuh:1389), and on a batch
#   that fills its waves well (>= 75 %, up to 2048 tokens) ik launches one block per tile instead of 2 per SM
#   (fattn-mma-f16.cuh:1372-1385): 264 MiB at 2048 tokens for Qwen3-30B-A3B's 32 heads of 128, 66 MiB at 512.
#   Mainline always takes the stream-k path on Ada and newer, with a block count bounded by the SMs.
# - the MoE ops (MOE_FUSED_UP_GATE, MUL_MAT_ID) on the GPU that runs them: the experts' GPU, or the first GPU when
#   op offload uploads RAM-resident experts for the batch. Their q8_1 activations, row ids and F32 up/gate results
#   grow with tokens x n_expert_used (_ik_moe_op_pool): 272.5 MiB at 4096 tokens for Qwen3-30B-A3B, where the
#   attention is back to 68.
#
# Mainline's pool is part of the overhead its profiles were calibrated on, so both terms are ik's. docs/ik_llama.md
# has the derivations and the H100 numbers.

VMM_GRANULARITY = 2 * MiB     # cuMemGetAllocationGranularity(RECOMMENDED) on NVIDIA GPUs
POOL_ALIGNMENT = 128          # ggml_cuda_pool_vmm::alloc rounds every request to 128 bytes
FATTN_KQ_STRIDE = 256         # ggml-cuda/fattn-common.cuh
DEFAULT_N_SM = 128            # SMs of a GPU whose profile does not say (an RTX 4090's)


def _pool_round(n: int) -> int:
    return -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT


def _ik_fattn_pool(n_tokens: int, head_dim: int, n_head: int, n_head_kv: int, cells: int, n_swa: int,
                   convert_k: bool, convert_v: bool, n_sm: int) -> int:
    """Pool bytes ik's MMA flash attention holds at once for a batch of n_tokens (ggml-cuda/fattn.cu:34-172,
    fattn-mma-f16.cu:152-260, fattn-mma-f16.cuh:1269-1432)."""
    gqa = n_head // n_head_kv
    ncols2 = next(c for c in (8, 4, 2, 1) if gqa % c == 0)          # the GQA-optimised kernels (mask, no ALiBi)
    ncols1 = next((c // ncols2 for c in (8, 16, 32) if n_tokens <= c // ncols2), 64 // ncols2)
    ncols = ncols1 * ncols2
    n_kv = cells
    if n_swa > 0:                                                   # fattn.cu:53-71: only the window is attended
        window = FATTN_KQ_STRIDE * (-(-(max(FATTN_KQ_STRIDE, n_tokens) + n_swa) // FATTN_KQ_STRIDE))
        n_kv = min(cells, window)
    used = 0
    if convert_k:
        used += _pool_round(2 * head_dim * n_kv * n_head_kv)
    if convert_v:
        used += _pool_round(2 * head_dim * n_kv * n_head_kv)
    ntiles_x = -(-n_tokens // ncols1)
    if n_tokens >= 1024:                                            # KV_min_max: one int2 per tile row
        used += _pool_round(8 * ntiles_x)
    ntiles_total = ntiles_x * (n_head // ncols2)
    max_blocks = 2 * n_sm if n_tokens > 1 else n_sm
    nwaves = -(-ntiles_total // max_blocks)
    efficiency = 100 * ntiles_total // (max_blocks * nwaves)
    blocks = max_blocks if efficiency < 75 or n_tokens > 2048 else ntiles_total
    used += _pool_round(blocks * ncols * (4 + head_dim) * 4 * 8)
    return used


def _granular(n: int) -> int:
    return -(-n // VMM_GRANULARITY) * VMM_GRANULARITY


Batches = int | tuple[int, ...]   # the batch sizes a run decodes: n means every size 1..n (a server); or a tuple


def _sizes(batches: Batches) -> Sequence[int]:
    return range(1, batches + 1) if isinstance(batches, int) else batches


@functools.lru_cache(maxsize=256)
def _ik_fattn_peak(batches: Batches, head_dim: int, n_head: int, n_head_kv: int, cells: int, n_swa: int,
                   convert_k: bool, convert_v: bool, n_sm: int) -> int:
    return _granular(max((_ik_fattn_pool(b, head_dim, n_head, n_head_kv, cells, n_swa, convert_k, convert_v, n_sm)
                          for b in _sizes(batches)), default=0))


def ik_fattn_pool_bytes(max_tokens: int, head_dim: int, n_head: int, n_head_kv: int, cells: int, n_swa: int = 0,
                        convert_k: bool = False, convert_v: bool = False, n_sm: int = DEFAULT_N_SM) -> int:
    """The pool ik's flash attention grows to over batches of 1..max_tokens tokens (a server sees every size up
    to the ubatch), rounded to the VMM granularity. Not monotonic: past 2048 tokens, or on a poorly filled last
    wave, the kernel falls back to 2 blocks per SM and the temporary shrinks."""
    return _ik_fattn_peak(max_tokens, head_dim, n_head, n_head_kv, cells, n_swa, convert_k,
                          convert_v, n_sm)


# The MoE ops. ik 8337e4cd, GPUs with int8 tensor cores (Turing and newer; older ones and AMD pick other kernels).
# Quantized experts of an MMQ type (ggml-cuda/mmq.cu:185-228, the same list as mmq_id.cu:499-545) take the grouped
# MMQ path while tokens <= mmq_id_thresh * n_expert (ggml-cuda.cu:2906, :3210); otherwise, or for other types, the
# older per-expert loop (ggml-cuda.cu:2911-3030, :3310-3536).
MMQ_TYPES = frozenset({
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_0", "Q8_0", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
    "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_S_R4", "IQ4_XS", "IQ4_NL", "IQ2_KS", "IQ2_KL", "IQ2_K",
    "IQ2_K_R4", "IQ3_KS", "IQ3_K", "IQ3_K_R4", "IQ4_KSS", "IQ4_KS", "IQ4_KS_R4", "IQ4_K", "IQ4_K_R4", "IQ5_KS",
    "IQ5_KS_R4", "IQ5_K", "IQ5_K_R4", "IQ6_K", "IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT"})
MMQ_ID_THRESH = 32            # ggml-cuda/common.cuh:857 (-cuda mmq-id-thresh=N changes it)
MMVQ_MAX_BATCH_SIZE = 8       # ggml-cuda/mmvq.cuh:10
MATRIX_ROW_PADDING = 512      # ggml-cuda/common.cuh:63: q8_1 rows are padded to it
MMQ_X_MAX = 128               # mmq.cuh:131 get_mmq_x_max_host with int8 MMA
MMQ_Y = 128                   # mmq.cuh:160 get_mmq_y_host (NVIDIA from Volta)
Q8_1_MMQ_BLOCK = 144          # sizeof(block_q8_1_mmq), 128 values (mmq.cuh:32-53)


def _q8_1(rows: int, ne10: int, mmq: bool = True) -> int:
    """A pool request for `rows` rows of ne10 F32 values quantized to q8_1 (36 bytes per 32, rows padded to
    MATRIX_ROW_PADDING); the MMQ layout asks for MMQ_X_MAX extra blocks (mmq_id.cu:459-460, ggml-cuda.cu:3225-3226)."""
    n = rows * (-(-ne10 // MATRIX_ROW_PADDING) * MATRIX_ROW_PADDING) // 32 * 36
    return _pool_round(n + (MMQ_X_MAX * Q8_1_MMQ_BLOCK if mmq else 0))


def _mmq_fixup(n_cols: int, nrows_x: int, nchannels: int, n_sm: int) -> int:
    """The stream-k fixup buffer of an MMQ-id launch (mmq_id_common.cuh:4010-4016): nsm * mmq_x * mmq_y floats
    unless the tiles divide evenly among the SMs; mmq_x is the smallest tile width with the fewest column tiles
    (mmq_id_common.cuh:4067-4083, granularity 16 from 48 columns)."""
    best, tiles = 0, n_cols + 1
    for x in range(8, MMQ_X_MAX + 1, 8):
        if tiles <= 1:
            break
        if x >= 48 and x % 16:
            continue
        t = -(-n_cols // x)
        if t < tiles:
            best, tiles = x, t
    nty = -(-nrows_x // MMQ_Y)
    return 0 if tiles * nty * nchannels % n_sm == 0 else _pool_round(n_sm * best * MMQ_Y * 4)


@dataclass(frozen=True)
class MoeShape:
    """One layer's routed experts as the MoE ops see them: up/gate rows (n_ff; merged: 2 * n_ff) from n_embd."""
    n_embd: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    merged: bool              # one ffn_gate_up_exps tensor (ik -muge / merged GGUFs): src0_2 is null
    mmq_up: bool              # up/gate experts of an MMQ type
    mmq_down: bool


def _ik_moe_op_pool(op: str, b: int, m: MoeShape, n_sm: int) -> int:
    """Pool bytes one MoE op holds at once for a batch of b tokens. op: "fused" (MOE_FUSED_UP_GATE with the
    down projection next on the same GPU, which it runs itself when it can and which follows it otherwise),
    "fused_alone" (the down runs elsewhere), "up" (MUL_MAT_ID of up or gate), "down" (MUL_MAT_ID of the down
    projection)."""
    E, U, R = m.n_expert, m.n_expert_used, b * m.n_expert_used
    rows_ug = 2 * m.n_ff if m.merged else m.n_ff
    f32 = _pool_round
    fused = op in ("fused", "fused_alone")
    mmq = m.mmq_down if op == "down" else m.mmq_up
    # the down projection after a fused up/gate that cannot run it (not an MMQ type): its own MUL_MAT_ID
    after = _ik_moe_op_pool("down", b, m, n_sm) if op == "fused" and not m.mmq_down else 0
    if fused and b <= MMVQ_MAX_BATCH_SIZE and mmq:
        # ggml-cuda.cu:3045-3140: token generation, q8_1 of the tokens and, fused, of the up/gate result
        return max(after, _q8_1(b, m.n_embd, False) + (_q8_1(R, m.n_ff, False) if op == "fused" and m.mmq_down
                                                        else 0))
    if not fused and b == 1 and mmq and (op == "up" or U <= MMVQ_MAX_BATCH_SIZE):
        return _q8_1(1 if op == "up" else U, m.n_embd if op == "up" else m.n_ff, False)  # ggml-cuda.cu:2843-2874
    grouped = mmq and b <= MMQ_ID_THRESH * E
    if fused and grouped:
        # ggml-cuda.cu:3215-3227: row ids (ids_src1, ids_dst, expert_bounds in one request) and the tokens' q8_1
        # rows, one per (token, expert); :3235-3236 / :3270-3271 the F32 up and gate results (merged: up_gate at
        # twice the width and an unused gate buffer); their MMQ launches take the stream-k fixup
        base = f32(4 * (2 * R + E + 1)) + _q8_1(R, m.n_embd)
        dst = f32(8 * R * m.n_ff) + f32(4 * R * m.n_ff) if m.merged else 2 * f32(4 * R * m.n_ff)
        peak = base + dst + _mmq_fixup(b, rows_ug, E, n_sm)
        if op == "fused" and m.mmq_down:
            # :3300-3304: the down projection while ids and q8_1 are still held (the F32 results are freed):
            # mmq_id.cu:398-413 its own row ids, :459-470 q8_1 of the up/gate product
            down = f32(4 * R) * 2 + f32(4 * (E + 1)) + _q8_1(R, m.n_ff) + _mmq_fixup(b, m.n_embd, E, n_sm)
            peak = max(peak, base + down)
        return max(peak, after)
    if fused:
        # ggml-cuda.cu:3352-3388: q8_1 (or an F32 copy) of the tokens, the F32 up and gate results, the fused
        # down's result (asked for in bytes of its element count, :3379), the row mapping; then per expert (at
        # most b rows) the MMQ fixup and the down projection's q8_1 input (:3508-3510 -> mmq_id.cu:370-376)
        held = (_q8_1(b, m.n_embd) if mmq else f32(4 * b * m.n_embd)) + f32(8 * R)
        held += f32(8 * R * m.n_ff) + f32(4 * R * m.n_ff) if m.merged else 2 * f32(4 * R * m.n_ff)
        per_expert = _mmq_fixup(b, rows_ug, 1, n_sm) if mmq else 0
        if op == "fused":
            held += _pool_round(R * m.n_embd)
            if m.mmq_down:
                per_expert = max(per_expert, _q8_1(b, m.n_ff) + _mmq_fixup(b, m.n_embd, 1, n_sm))
        return held + per_expert
    ne10, ne01 = (m.n_embd, rows_ug) if op == "up" else (m.n_ff, m.n_embd)
    if grouped:
        # ggml-cuda.cu:2906-2909 -> mmq_id.cu:398-413 row ids, :459-470 q8_1 of (token, expert) rows, the fixup
        return f32(4 * R) * 2 + f32(4 * (E + 1)) + _q8_1(R, ne10) + _mmq_fixup(b, ne01, E, n_sm)
    # ggml-cuda.cu:2944-2952: the row mapping, F32 copies of src1 (the tokens once for up/gate, one row per
    # (token, expert) for down) and of dst; per expert (at most b rows) q8_1 of its rows and the fixup (:2990-3002)
    src1 = b * ne10 if op == "up" else R * ne10
    held = f32(8 * R) + f32(4 * src1) + f32(4 * R * ne01)
    return held + (_q8_1(b, ne10) + _mmq_fixup(b, ne01, 1, n_sm) if mmq else 0)


NO_LIMIT = 1 << 62


@functools.lru_cache(maxsize=1024)
def _ik_moe_peak(batches: Batches, ops: tuple[tuple[str, int, int], ...], m: MoeShape, n_sm: int) -> int:
    """The most pool bytes any of `ops` (op, batches lo <= b < hi at which this GPU runs it) holds over
    `batches`."""
    return max((_ik_moe_op_pool(op, b, m, n_sm) for op, lo, hi in ops for b in _sizes(batches) if lo <= b < hi),
               default=0)


def _moe_layers(inv: ModelInventory) -> list[tuple[int, dict[str, Tensor]]]:
    out = []
    for il in inv.moe_layers():
        ts = {t.role: t for t in inv.by_layer.get(il, ()) if t.is_expert}
        if "exps_down" in ts and ("exps_gate_up" in ts or {"exps_up", "exps_gate"} <= ts.keys()):
            out.append((il, ts))
    return out


def ik_fuses_up_gate(plan: Plan, up: Tensor, gate: Tensor | None) -> bool:
    """Whether ik runs this layer's up and gate experts as one MOE_FUSED_UP_GATE (llama-build-context.cpp:1583-1609):
    a merged gate_up tensor (gate None) always, separate ones with -fmoe (ik's default) when of one type. The op
    runs where the up experts are (ggml-backend.cpp:1340-1360, its first weight source), and a gate elsewhere is
    copied into that device's compute buffer for every batch."""
    return plan.dialect == "ik" and (gate is None or (plan.knobs.fmoe and up.ggml_type == gate.ggml_type))


def _moe_op_device(inv: ModelInventory, plan: Plan, gpu0: str | None, t: Tensor, op_class: str
                   ) -> tuple[str | None, int]:
    """(GPU, smallest batch) on which the MoE op on expert tensor t runs; (None, 0) if only on the CPU."""
    dev = plan.assignment.get(t.name, "CPU")
    if dev != "CPU":
        return dev, 1
    lo = offload_min_batch(inv, plan, t, op_class) if gpu0 is not None else None
    return (gpu0, lo) if lo is not None else (None, 0)


def _ik_moe_ops(inv: ModelInventory, plan: Plan, gpu0: str | None) -> list[tuple[str, MoeShape, tuple]]:
    """Per GPU, the MoE ops it runs in each layer, with the smallest batch from which it runs them there: 1 for
    experts in its VRAM; for experts in RAM on the first GPU, the batch from which ik offloads the op
    (ggml-cuda.cu:5194-5210: batch >= min_batch and batch * n_expert_used >= min_batch * n_expert), if its
    OffloadPolicy rule is on (-op) and -rtr is off. With -fmoe (knobs.fmoe) and up and gate of one type ik builds
    MOE_FUSED_UP_GATE (llama-build-context.cpp:1583-1609), which runs the down projection itself when it is the
    next node on the same GPU (ggml-cuda.cu:3300, :3343); a merged gate_up tensor is always fused."""
    hp = inv.hparams
    out = []
    for _, ts in _moe_layers(inv):
        down = ts["exps_down"]
        merged = "exps_gate_up" in ts
        up = ts["exps_gate_up"] if merged else ts["exps_up"]
        n_ff = up.shape[1] // 2 if merged else up.shape[1]
        n_expert = up.shape[2] if len(up.shape) > 2 else hp.n_expert
        used = hp.n_expert_used
        if used <= 0 or n_expert <= 0:
            continue
        m = MoeShape(up.shape[0], n_ff, n_expert, used, merged, up.ggml_type in MMQ_TYPES,
                     down.ggml_type in MMQ_TYPES)
        where = functools.partial(_moe_op_device, inv, plan, gpu0)
        d_dev, d_lo = where(down, "moe_matmul")
        fused = ik_fuses_up_gate(plan, up, None if merged else ts["exps_gate"])
        if not fused:
            for t in (ts["exps_up"], ts["exps_gate"]):
                dev, lo = where(t, "moe_matmul")
                if dev is not None:
                    out.append((dev, m, (("up", lo, NO_LIMIT),)))
            if d_dev is not None:
                out.append((d_dev, m, (("down", d_lo, NO_LIMIT),)))
            continue
        u_dev, u_lo = where(up, "moe_fused_up_gate")
        if u_dev is not None and u_dev == d_dev:
            # both on this GPU from max(u_lo, d_lo); below that only the one whose threshold is lower
            both = max(u_lo, d_lo)
            out.append((u_dev, m, (("fused", both, NO_LIMIT), ("fused_alone", u_lo, both), ("down", d_lo, both))))
            continue
        if u_dev is not None:
            out.append((u_dev, m, (("fused_alone", u_lo, NO_LIMIT),)))
        if d_dev is not None:
            out.append((d_dev, m, (("down", d_lo, NO_LIMIT),)))
    return out


def pool_bytes(inv: ModelInventory, plan: Plan, hw: HardwareProfile | None = None,
               batches: Sequence[int] | None = None) -> dict[str, int]:
    """Per GPU, the CUDA pool the plan's run keeps (ik dialect): the largest set of temporaries one op holds, over
    the attention of the layers whose KV the GPU holds (flash attention) and the MoE ops it runs, rounded to the
    VMM granularity. batches: the batch sizes the run decodes; default every size from 1 to the ubatch, as a
    server sees (llama-sweep-bench runs only the ubatch and single tokens). Not modelled (0): mainline (its pool
    peaks are part of the calibrated overhead), ik's attention without flash attention, MLA and K/V head sizes
    that differ (other kernels), and the smaller temporaries of the other ops."""
    knobs, hp = plan.knobs, inv.hparams
    if plan.dialect != "ik":
        return {}
    sizes: Batches = (tuple(sorted({b for b in batches if 1 <= b <= knobs.n_ubatch_eff})) if batches is not None
                      else knobs.n_ubatch_eff)

    def sms(dev: str) -> int:
        if hw is not None and gpu_index(dev) < len(hw.gpus) and hw.gpu(dev).n_sm > 0:
            return hw.gpu(dev).n_sm
        return DEFAULT_N_SM

    out: dict[str, int] = {}
    if knobs.flash_attn and not knobs.no_kv_offload and not hp.is_mla and hp.head_dim_k == hp.head_dim_v:
        homes = home_devices(inv, plan)
        for il in range(hp.n_layer - hp.n_nextn):
            dev = homes[il]
            n_head_kv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
            if dev == "CPU" or n_head_kv <= 0:
                continue
            swa = hp.n_swa if il < len(hp.swa_layers) and hp.swa_layers[il] else 0
            b = _ik_fattn_peak(sizes, hp.head_dim_k, hp.n_head, n_head_kv, kv_cells(inv, knobs, il, plan.dialect),
                               swa, knobs.type_k != "f16", knobs.type_v != "f16", sms(dev))
            out[dev] = max(out.get(dev, 0), b)
    gpus = sorted({d for d in plan.assignment.values() if d != "CPU"}, key=device_sort_key)
    for dev, m, ops in dict.fromkeys(_ik_moe_ops(inv, plan, gpus[0] if gpus else None)):
        b = _granular(_ik_moe_peak(sizes, ops, m, sms(dev)))
        if b:
            out[dev] = max(out.get(dev, 0), b)
    return out
