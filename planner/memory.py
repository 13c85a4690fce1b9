"""Bytes per device and component (weights, kv, compute, overhead) of a Plan, per dialect.

Facts: ../shared/reference/llamacpp.md sections 2-6, checked against llama.cpp's llama-context.cpp and
llama-kv-cache(-iswa).cpp of the vendored version. A layer's KV cache and activations live on the layer's
*home* device: the device its -ngl slot gives it, which in a Plan is the device of `blk.N.attn_norm.weight`
(flags/ never overrides a norm, so the two agree).

Compute buffers are modelled as ggml-alloc's peak of live f32 activations per device, for the worst-case
ubatch (what llama.cpp reserves at start-up), plus the graph inputs each device needs and, with op offload, the
upload targets of RAM-resident weights. The per-phase live sets below are the ggml graph's tensors that are
alive at once; the integration test (tests/planner/test_memory_llamacpp.py) holds them to llama.cpp's own
numbers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .ggml_types import by_name
from .hardware import MiB, HardwareProfile
from .model import ModelInventory, Tensor
from .plan import Knobs, Plan, device_sort_key

# Bytes per element of a KV row for each cache type (reference section 5; ggml type table).
KV_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
           "q5_0": "Q5_0", "q5_1": "Q5_1", "iq4_nl": "IQ4_NL"}
DEFAULT_GPU_OVERHEAD = 600 * MiB   # CUDA context + cuBLAS workspace per GPU (reference section 6: 300-800 MiB)
HOST_PROCESS_OVERHEAD = 256 * MiB  # the process itself: code, tokenizer, small host buffers


@dataclass(frozen=True)
class DeviceMemory:
    weights: int = 0
    kv: int = 0
    compute: int = 0
    overhead: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class MemoryReport:
    devices: dict[str, DeviceMemory]
    host_mapped: int = 0        # CPU weights served from the mmap'd file (page cache, evictable)
    host_pinned: int = 0        # CPU weights copied into pinned / anonymous memory (not evictable)
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        devs = sorted(self.devices, key=device_sort_key)
        return {"devices": {d: self.devices[d].to_dict() for d in devs},
                "host": {"mapped": self.host_mapped, "pinned": self.host_pinned}}

    def gpu_total(self, device: str) -> int:
        return self.devices.get(device, DeviceMemory()).total


# ---- where things are -----------------------------------------------------------------------------------------

def home_devices(inv: ModelInventory, plan: Plan) -> list[str]:
    """Device of each layer's -ngl slot (KV, activations), from its attn_norm; CPU for unallocated layers."""
    out = []
    for il in range(inv.n_layer):
        out.append(plan.assignment.get(f"blk.{il}.attn_norm.weight", "CPU"))
    return out


def output_device(inv: ModelInventory, plan: Plan) -> str:
    name = "output_norm.weight" if inv.tied_output else "output.weight"
    return plan.assignment.get(name, "CPU")


# ---- weights ----------------------------------------------------------------------------------------------------

def weight_bytes(inv: ModelInventory, plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in inv.allocated():
        dev = plan.assignment.get(t.name, "CPU")
        out[dev] = out.get(dev, 0) + t.nbytes
    if inv.tied_output:   # token_embd is loaded a second time as the output, on the output's device
        dev = output_device(inv, plan)
        if dev != "CPU":
            out[dev] = out.get(dev, 0) + inv.by_name["token_embd.weight"].nbytes
    return out


# ---- KV cache ---------------------------------------------------------------------------------------------------

def kv_cells(inv: ModelInventory, knobs: Knobs, il: int, dialect: str) -> int:
    """Cells of layer il's cache: n_ctx padded to 256; SWA layers (mainline) pad256(min(n_ctx, n_swa*n_seq + ub))."""
    hp = inv.hparams
    size = knobs.kv_size
    is_swa = il < len(hp.swa_layers) and hp.swa_layers[il] and hp.n_swa > 0
    if is_swa and dialect == "mainline" and not knobs.swa_full:
        swa = -(-min(size, hp.n_swa * knobs.n_seq + knobs.n_ubatch_eff) // 256) * 256
        return swa
    return size


def kv_layer_bytes(inv: ModelInventory, knobs: Knobs, il: int, dialect: str) -> int:
    hp = inv.hparams
    if il >= hp.n_layer - hp.n_nextn:
        return 0   # NextN layers get no cache (llama-model.cpp create_memory filter il < n_layer())
    n_kv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
    cells = kv_cells(inv, knobs, il, dialect)
    tk, tv = by_name(KV_TYPE[knobs.type_k]), by_name(KV_TYPE[knobs.type_v])
    if hp.is_mla and not (dialect == "ik" and knobs.mla == 0):
        # one K-only cache of kv_lora_rank + n_rot per token (the GGUF's key_length, head_count_kv 1)
        return cells * tk.row_bytes(hp.mla_kv_lora_rank + hp.n_rot)
    if hp.is_mla:   # ik -mla 0: the original attention, full K (192/head) and V (128/head) for every head
        return cells * (tk.row_bytes(hp.n_head * 192) + tv.row_bytes(hp.n_head * 128))
    return cells * (tk.row_bytes(n_kv * hp.head_dim_k) + tv.row_bytes(n_kv * hp.head_dim_v))


def kv_bytes(inv: ModelInventory, plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    homes = home_devices(inv, plan)
    for il in range(inv.n_layer):
        dev = "CPU" if plan.knobs.no_kv_offload else homes[il]
        out[dev] = out.get(dev, 0) + kv_layer_bytes(inv, plan.knobs, il, plan.dialect)
    return out


# ---- compute buffers --------------------------------------------------------------------------------------------

F32 = 4


def _attn_live(inv: ModelInventory, il: int, T: int, n_kv: int, flash_attn: bool) -> int:
    hp = inv.hparams
    hkv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
    if hp.is_mla:
        q = hp.n_head * (hp.mla_kv_lora_rank + hp.n_rot)        # absorbed q in latent space
        kv = hp.mla_kv_lora_rank + hp.n_rot
        o = hp.n_head * hp.mla_kv_lora_rank
        width = 2 * hp.n_embd + 2 * q + kv + o
    else:
        width = 2 * hp.n_embd + hp.n_head * hp.head_dim_k + hkv * (hp.head_dim_k + hp.head_dim_v) \
            + 2 * hp.n_head * hp.head_dim_v
    kq = 0 if flash_attn else 2 * n_kv * T * hp.n_head * F32   # KQ and softmax(KQ)
    return F32 * T * width + kq


def _ffn_live(inv: ModelInventory, il: int, T: int) -> int:
    hp = inv.hparams
    E = hp.n_embd
    if il < len(hp.moe_layers) and hp.moe_layers[il]:
        A, X, Fe = hp.n_expert_used, hp.n_expert, hp.n_ff_exp
        routed = 2 * X + A * (2 * Fe + E)           # router logits + probs; up, gate, down per chosen expert
        shared = 2 * hp.n_ff_shexp + E if hp.n_ff_shexp else 0
        return F32 * T * (3 * E + routed + shared)
    return F32 * T * (3 * E + 3 * hp.n_ff)


def _output_live(inv: ModelInventory, T: int) -> int:
    return F32 * T * (2 * inv.hparams.n_embd + inv.hparams.n_vocab)


def _mask_bytes(knobs: Knobs, T: int) -> int:
    # KQ mask [n_kv, T] in f32 (f16 copy for flash attention adds half again)
    return knobs.kv_size * T * (F32 + (2 if knobs.flash_attn else 0))


def offload_min_batch(inv: ModelInventory, plan: Plan, tensor: Tensor) -> int | None:
    """Smallest batch at which the op on this RAM-resident weight runs on a GPU; None if it never does.

    mainline: every MUL_MAT / MUL_MAT_ID with batch >= min_batch (GET_ROWS never). ik: the same, but MoE ops
    only from min_batch * n_expert / n_expert_used (reference section 4)."""
    if tensor.role == "token_embd" or len(tensor.shape) < 2:
        return None
    op = "moe_matmul" if tensor.is_expert else ("output" if tensor.role == "output" else "dense_matmul")
    rule = plan.knobs.offload.rule(op)
    if not rule.enabled or plan.knobs.rtr:
        return None
    hp = inv.hparams
    if plan.dialect == "ik" and tensor.is_expert and hp.n_expert_used:
        return rule.min_batch * hp.n_expert // hp.n_expert_used
    return rule.min_batch


def _offloaded(inv: ModelInventory, tensor: Tensor, plan: Plan, T: int, has_gpu: bool = True) -> bool:
    if not has_gpu:
        return False
    m = offload_min_batch(inv, plan, tensor)
    return m is not None and T >= m


def compute_bytes(inv: ModelInventory, plan: Plan) -> dict[str, int]:
    """Per-device compute buffer for the worst-case ubatch; the CPU's is the max of PP and TG reservations."""
    knobs, hp = plan.knobs, inv.hparams
    T = knobs.n_ubatch_eff
    homes = home_devices(inv, plan)
    gpus = sorted({d for d in plan.assignment.values() if d != "CPU"}, key=device_sort_key)
    first_gpu = gpus[0] if gpus else "CPU"
    out_dev = output_device(inv, plan)
    peak: dict[str, int] = {}
    inputs: dict[str, int] = {}

    def bump(dev: str, live: int) -> None:
        peak[dev] = max(peak.get(dev, 0), live)

    for batch in ((T, 1) if T > 1 else (T,)):
        for il in range(hp.n_layer - hp.n_nextn):
            home = homes[il]
            layer = inv.by_layer.get(il, ())
            bump(home, _attn_live(inv, il, batch, knobs.kv_size, knobs.flash_attn))
            # the FFN runs where its weights are, or on the GPU when a RAM-resident weight is offloaded
            ffn_w = [t for t in layer if t.role in ("ffn_dense", "exps_gate", "exps_up", "exps_down", "exps_gate_up")]
            on_cpu = [t for t in ffn_w if plan.assignment.get(t.name, "CPU") == "CPU"]
            ffn_dev = home
            if on_cpu and len(on_cpu) == len(ffn_w) and not any(_offloaded(inv, t, plan, batch, bool(gpus)) for t in on_cpu):
                ffn_dev = "CPU"
            elif ffn_w and home == "CPU":
                dev_w = next((plan.assignment[t.name] for t in ffn_w if plan.assignment.get(t.name, "CPU") != "CPU"), None)
                if dev_w is not None:
                    ffn_dev = dev_w
                elif any(_offloaded(inv, t, plan, batch, bool(gpus)) for t in on_cpu):
                    ffn_dev = first_gpu
            bump(ffn_dev, _ffn_live(inv, il, batch))
            if ffn_dev != home:   # activations cross to the other device and back
                inputs[ffn_dev] = max(inputs.get(ffn_dev, 0), F32 * batch * hp.n_embd)
            # upload targets: full-size copies of the layer's RAM-resident weights its GPU ops use
            if ffn_dev != "CPU" and batch == T:
                up = sum(t.nbytes for t in on_cpu if _offloaded(inv, t, plan, batch, bool(gpus)))
                inputs[ffn_dev] = max(inputs.get(ffn_dev, 0), up)
        out_w = inv.by_name.get("output.weight") or inv.by_name["token_embd.weight"]
        odev = out_dev
        if odev == "CPU" and _offloaded(inv, out_w, plan, batch, bool(gpus)):
            odev = first_gpu
        bump(odev, _output_live(inv, batch))
    for dev in set(homes) | {out_dev}:
        inputs[dev] = inputs.get(dev, 0) + _mask_bytes(knobs, T)
    devices = set(peak) | set(inputs)
    return {d: peak.get(d, 0) + inputs.get(d, 0) for d in devices}


# ---- everything -------------------------------------------------------------------------------------------------

def estimate(inv: ModelInventory, plan: Plan, hw: HardwareProfile | None = None) -> MemoryReport:
    w, kv, comp = weight_bytes(inv, plan), kv_bytes(inv, plan), compute_bytes(inv, plan)
    devices = sorted(set(w) | set(kv) | set(comp) | {"CPU"}, key=device_sort_key)
    out = {}
    for d in devices:
        if d == "CPU":
            overhead = HOST_PROCESS_OVERHEAD
        elif hw is not None and int(d[4:]) < len(hw.gpus):
            overhead = hw.gpu(d).overhead_bytes
        else:
            overhead = DEFAULT_GPU_OVERHEAD
        out[d] = DeviceMemory(w.get(d, 0), kv.get(d, 0), comp.get(d, 0), overhead)
    cpu_w = w.get("CPU", 0)
    # mainline mmaps CPU weights (page cache); --no-mmap, and ik with any CPU override, copy them (pinned)
    has_override = any(dev == "CPU" for name, dev in plan.assignment.items() if "blk." in name) and \
        any(dev != "CPU" for dev in plan.assignment.values())
    pinned = (not plan.knobs.mmap) or (plan.dialect == "ik" and has_override)
    return MemoryReport(out, host_mapped=0 if pinned else cpu_w, host_pinned=cpu_w if pinned else 0)
