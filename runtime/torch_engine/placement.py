"""Putting a plan into memory: devices (real or logical GPUs), per-device accounting, weights, KV caches, and
the staging buffers that RAM-resident weights are uploaded into when an op on them runs on a GPU.

Devices are named as llama.cpp names them (CPU, CUDA0, ...). Without CUDA (CI, this laptop) the CUDAn of a plan
are "logical GPUs": tensors live in host memory but are accounted per logical device against a budget, and a
plan over budget fails as an out-of-memory would, so placement, offload decisions and counters run anywhere.

Packing: tensors that one op reads together and that share a device share one buffer (Q/K/V; gate and up of
the dense, shared and routed FFNs; their biases), so that op is one matmul. Every tensor is still placed on
exactly the device the plan names, and the bytes per device are the same as without packing.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping

import torch

from planner.errors import InputError
from planner.hardware import fmt_bytes
from planner.residency import home_devices, kv_cells
from planner.model import ModelInventory
from planner.plan import Plan, device_sort_key, gpu_index

from .config import ModelConfig
from .weights import WeightSource, torch_shape

GiB = 1 << 30
DEFAULT_LOGICAL_GPU_BYTES = 24 * GiB
PIN_MIN_BYTES = 1 << 20            # host tensors at least this large are page-locked (cudaHostRegister)


class OutOfMemory(RuntimeError):
    """A logical GPU's budget was exceeded (the engine reports it like torch.cuda.OutOfMemoryError)."""


def is_gpu(dev: str) -> bool:
    return dev.startswith("CUDA")


# ---- devices ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Devices:
    torch_of: dict[str, torch.device]     # plan device name -> torch device
    gpus: tuple[str, ...]                 # GPUs of this machine (real or logical); op offload targets gpus[0]
    logical: bool
    budgets: dict[str, int]               # logical GPUs only

    def torch(self, dev: str) -> torch.device:
        return self.torch_of[dev]

    @property
    def offload_target(self) -> str | None:
        return self.gpus[0] if self.gpus else None

    @property
    def cuda(self) -> bool:
        return not self.logical and bool(self.gpus)


def resolve_devices(plan_devices: Iterable[str], device_map: str | Mapping[str, str] | None,
                    logical_gpu_bytes: int | Mapping[str, int] | None) -> Devices:
    """Map plan devices to torch devices. device_map None: real GPUs when CUDA is available, else logical ones;
    "logical": logical GPUs even where CUDA exists; a dict {"CUDA0": "cuda:1", ...} pins the mapping."""
    wanted = sorted(set(plan_devices) | {"CPU"}, key=device_sort_key)
    bad = [d for d in wanted if d != "CPU" and not (is_gpu(d) and d[4:].isdigit())]
    if bad:
        raise InputError(f"the torch engine runs on CPU and CUDAn devices; the plan names {', '.join(bad)}")
    plan_gpus = [d for d in wanted if is_gpu(d)]
    if isinstance(device_map, Mapping):
        torch_of = {"CPU": torch.device("cpu")}
        for d in plan_gpus:
            if d not in device_map:
                raise InputError(f"device_map has no entry for {d}")
            torch_of[d] = torch.device(device_map[d])
        logical = all(torch_of[d].type == "cpu" for d in plan_gpus) if plan_gpus else not torch.cuda.is_available()
        gpus = tuple(plan_gpus) or (() if not torch.cuda.is_available() else ())
    elif device_map == "logical" or (device_map is None and not torch.cuda.is_available()):
        logical = True
        gpus = tuple(plan_gpus) or ("CUDA0",)
        torch_of = {d: torch.device("cpu") for d in ("CPU",) + gpus}
    elif device_map is None:
        logical = False
        n = torch.cuda.device_count()
        missing = [d for d in plan_gpus if gpu_index(d) >= n]
        if missing:
            raise InputError(f"the plan puts tensors on {', '.join(missing)}, but this machine has {n} GPU(s)")
        gpus = tuple(f"CUDA{i}" for i in range(n))
        torch_of = {"CPU": torch.device("cpu"), **{g: torch.device(f"cuda:{g[4:]}") for g in gpus}}
    else:
        raise InputError(f"bad device_map {device_map!r}: None, 'logical' or a dict like {{'CUDA0': 'cuda:0'}}")
    budgets: dict[str, int] = {}
    if logical:
        for g in gpus:
            if isinstance(logical_gpu_bytes, Mapping):
                budgets[g] = int(logical_gpu_bytes.get(g, DEFAULT_LOGICAL_GPU_BYTES))
            else:
                budgets[g] = int(logical_gpu_bytes or DEFAULT_LOGICAL_GPU_BYTES)
    return Devices(torch_of, gpus, logical, budgets)


# ---- accounting ----------------------------------------------------------------------------------------------------

class Accountant:
    """Bytes per device: static (weights, KV, staging) plus the live activations the executor reports.
    `parts[dev]` splits a device's static bytes by kind ("weights", "kv", "staging")."""

    def __init__(self, devices: Devices) -> None:
        self.devices = devices
        self.static: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.parts: dict[str, Counter[str]] = {}

    def _check(self, dev: str, total: int, what: str) -> None:
        budget = self.devices.budgets.get(dev)
        if budget is not None and total > budget:
            raise OutOfMemory(f"out of memory on {dev} (logical GPU): {what} brings it to {fmt_bytes(total)}, "
                              f"over its budget of {fmt_bytes(budget)}")

    def reserve(self, dev: str, nbytes: int, what: str, kind: str = "weights") -> None:
        self._check(dev, self.static[dev] + nbytes, what)
        self.static[dev] += nbytes
        self.parts.setdefault(dev, Counter())[kind] += nbytes
        self.peak[dev] = max(self.peak[dev], self.static[dev])

    def observe(self, dev: str, live_bytes: int) -> None:
        total = self.static[dev] + live_bytes
        self._check(dev, total, f"{fmt_bytes(live_bytes)} of activations")
        self.peak[dev] = max(self.peak[dev], total)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- counters ------------------------------------------------------------------------------------------------------

@dataclass
class Counters:
    """What ran where: ops per (op class, device), ops offloaded to a GPU, bytes uploaded and moved."""
    ops: Counter = field(default_factory=Counter)              # "moe_matmul@CPU" -> count
    offloaded: Counter = field(default_factory=Counter)        # "moe_matmul" -> count
    upload_bytes: int = 0                                       # bytes copied host -> GPU for offloaded ops
    upload_model_bytes: int = 0                                 # the same uploads in the model file's bytes
    uploads: int = 0
    transfer_bytes: int = 0                                     # activations crossing devices
    transfers: int = 0

    def clear(self) -> None:
        self.ops.clear()
        self.offloaded.clear()
        self.upload_bytes = self.upload_model_bytes = self.uploads = self.transfer_bytes = self.transfers = 0

    def add(self, other: Counters, times: int = 1) -> None:
        for k, v in other.ops.items():
            self.ops[k] += v * times
        for k, v in other.offloaded.items():
            self.offloaded[k] += v * times
        self.upload_bytes += other.upload_bytes * times
        self.upload_model_bytes += other.upload_model_bytes * times
        self.uploads += other.uploads * times
        self.transfer_bytes += other.transfer_bytes * times
        self.transfers += other.transfers * times

    def to_dict(self) -> dict:
        return {"ops": dict(sorted(self.ops.items())), "offloaded": dict(sorted(self.offloaded.items())),
                "upload_bytes": self.upload_bytes, "upload_model_bytes": self.upload_model_bytes,
                "uploads": self.uploads, "transfer_bytes": self.transfer_bytes, "transfers": self.transfers}


# ---- weights -------------------------------------------------------------------------------------------------------

# Tensors one op reads together, packed into one buffer when they share a device (suffixes after "blk.N.").
PACK_GROUPS: tuple[tuple[str, ...], ...] = (
    ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    ("ffn_gate.weight", "ffn_up.weight"),
    ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
    ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
)
EXPERT_PREFIXES = ("ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.")


def is_float32_tensor(name: str) -> bool:
    """Kept in float32 whatever the compute dtype: routers, norms, sinks, the routing bias (F32 in GGUF files)."""
    return (".ffn_gate_inp." in name or "exp_probs_b" in name or "norm" in name or "attn_sinks" in name
            or "ffn_gate_inp_shexp" in name)


@dataclass
class Buffer:
    """One allocation: its storage tensor, device, and the member tensors it holds (in order)."""
    names: tuple[str, ...]
    device: str
    storage: torch.Tensor
    pinned: bool = False


class PlacedWeights:
    """Every allocated tensor on its plan device. `get(name)` is the tensor in its torch shape (a view into
    its buffer); `buffer(name)` the allocation that holds it."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.device_of: dict[str, str] = {}
        self.buffers: dict[str, Buffer] = {}          # member name -> its buffer
        self.replicas: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def buffer(self, name: str) -> Buffer:
        return self.buffers[name]

    def packed(self, names: tuple[str, ...]) -> Buffer | None:
        """The buffer holding exactly `names` (in order), if they were packed together."""
        buf = self.buffers.get(names[0])
        return buf if buf is not None and buf.names == names else None


class BufferCache:
    """Weight buffers kept between runs of the same model: a plan that keeps a tensor on the same device reuses
    its buffer (a benchmark sweeping placements of a 60 GB model re-creates only what moved). Owns the
    page-locking of host buffers (cudaHostRegister, undone before a buffer is dropped)."""

    def __init__(self) -> None:
        self.fingerprint: tuple | None = None
        self.buffers: dict[tuple, tuple[Buffer, dict[str, torch.Tensor]]] = {}
        self._used: set[tuple] = set()

    def reset_for(self, fingerprint: tuple) -> None:
        if fingerprint != self.fingerprint:
            self.close()
            self.fingerprint = fingerprint
        self._used = set()

    def get(self, key: tuple) -> tuple[Buffer, dict[str, torch.Tensor]] | None:
        hit = self.buffers.get(key)
        if hit is not None:
            self._used.add(key)
        return hit

    def put(self, key: tuple, buf: Buffer, views: dict[str, torch.Tensor], pin: bool) -> None:
        if pin and nbytes(buf.storage) >= PIN_MIN_BYTES:
            buf.pinned = _host_register(buf.storage)
        self.buffers[key] = (buf, views)
        self._used.add(key)

    def _drop(self, key: tuple) -> None:
        buf, _ = self.buffers.pop(key)
        if buf.pinned:
            torch.cuda.cudart().cudaHostUnregister(buf.storage.data_ptr())
            buf.pinned = False

    def sweep(self) -> None:
        """Drop the buffers the last placement did not use."""
        for key in [k for k in self.buffers if k not in self._used]:
            self._drop(key)

    def drop_unused_now(self, keep: set[tuple]) -> None:
        for key in [k for k in self.buffers if k not in keep]:
            self._drop(key)

    def close(self) -> None:
        for key in list(self.buffers):
            self._drop(key)

    def __del__(self) -> None:
        # registered memory must be unregistered before it is freed, or a later allocation at the same address
        # fails to register ("already mapped") and leaves a CUDA error that the next kernel launch reports
        self.close()


def _host_register(t: torch.Tensor) -> bool:
    """Page-lock t's memory in place (no copy, no power-of-two rounding as torch's pinned allocator does)."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes(t), 0)
    if int(rc) == 0:
        return True
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed cudaHostRegister (torch's cudart binding has no
    cudaGetLastError: call it in the libcudart this process loaded)."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _member_shapes(inv: ModelInventory, names: tuple[str, ...]) -> list[tuple[int, ...]]:
    return [torch_shape(inv.by_name[n].shape) for n in names]


def _make_buffer(inv: ModelInventory, names: tuple[str, ...], dev: str, devices: Devices, dtype: torch.dtype
                 ) -> tuple[Buffer, dict[str, torch.Tensor]]:
    """Allocate one buffer for `names` (same device) and return it with each member's view. Members are
    concatenated along their output rows: dim 0 of [N, K] matrices and vectors, dim 1 of stacked experts
    [E, N, K] and their biases [E, N]."""
    shapes = _member_shapes(inv, names)
    axis = 1 if names[0].split(".", 2)[-1].startswith(EXPERT_PREFIXES) and len(shapes[0]) >= 2 else 0
    widths = [sh[axis] for sh in shapes]
    full = list(shapes[0])
    full[axis] = sum(widths)
    storage = torch.empty(tuple(full), dtype=dtype, device=devices.torch(dev))
    views: dict[str, torch.Tensor] = {}
    n0 = 0
    for n, w in zip(names, widths):
        views[n] = storage.narrow(axis, n0, w)
        n0 += w
    return Buffer(names, dev, storage), views


def _groups(inv: ModelInventory, plan: Plan) -> list[tuple[str, ...]]:
    """Allocation units: packed groups where every member exists and shares a device, else single tensors."""
    out: list[tuple[str, ...]] = []
    taken: set[str] = set()
    for layer in sorted({t.layer for t in inv.allocated() if t.layer is not None}):
        for group in PACK_GROUPS:
            names = tuple(f"blk.{layer}.{s}" for s in group)
            if all(n in inv.by_name for n in names) and len({plan.assignment.get(n, "CPU") for n in names}) == 1:
                out.append(names)
                taken.update(names)
    for t in inv.allocated():
        if t.name not in taken:
            out.append((t.name,))
    return out


def buffer_keys(inv: ModelInventory, plan: Plan, dtype: torch.dtype) -> set[tuple]:
    """The BufferCache keys a placement of `plan` uses."""
    return {(names, plan.assignment.get(names[0], "CPU"), str(torch.float32 if is_float32_tensor(names[0]) else dtype))
            for names in _groups(inv, plan)}


def place_weights(inv: ModelInventory, plan: Plan, devices: Devices, source: WeightSource, dtype: torch.dtype,
                  acct: Accountant, output_device: str, cache: BufferCache) -> PlacedWeights:
    """Allocate and fill every allocated tensor on its plan device (NextN blocks are skipped, as llama.cpp does).
    Host buffers are page-locked when a real GPU exists, so uploads are asynchronous DMA at full PCIe speed.
    Buffers of `cache` that this placement does not use are freed first (before the new ones are made)."""
    pw = PlacedWeights()
    groups = []
    for names in _groups(inv, plan):
        dev = plan.assignment.get(names[0], "CPU")
        if dev not in devices.torch_of:
            raise InputError(f"{names[0]} is assigned to {dev}, which this engine does not have")
        groups.append((names, dev, torch.float32 if is_float32_tensor(names[0]) else dtype))
    cache.drop_unused_now(buffer_keys(inv, plan, dtype))
    for names, dev, tdtype in groups:
        key = (names, dev, str(tdtype))
        hit = cache.get(key)
        if hit is None:
            buf, views = _make_buffer(inv, names, dev, devices, tdtype)
            acct.reserve(dev, nbytes(buf.storage), f"weights {names[0]}")
            for n, v in views.items():
                source.fill(n, v)
            cache.put(key, buf, views, pin=dev == "CPU" and devices.cuda)
        else:
            buf, views = hit
            acct.reserve(dev, nbytes(buf.storage), f"weights {names[0]}")
        for n, v in views.items():
            pw.tensors[n] = v
            pw.device_of[n] = dev
            pw.buffers[n] = buf
    if inv.tied_output and output_device != plan.assignment.get("token_embd.weight", "CPU"):
        # llama.cpp loads token_embd a second time as the output, on the output's device
        emb = pw.get("token_embd.weight")
        dup = emb.to(devices.torch(output_device), copy=True)
        acct.reserve(output_device, nbytes(dup), "output (tied token_embd copy)")
        pw.replicas[("token_embd.weight", output_device)] = dup
    return pw


def replica(pw: PlacedWeights, name: str, dev: str, devices: Devices) -> torch.Tensor:
    """`name` on `dev`: the placed tensor if it lives there, else a small copy (norm and sink vectors an op on
    another device needs; never matrices)."""
    if pw.device_of.get(name) == dev and (name, dev) not in pw.replicas:
        return pw.get(name)
    key = (name, dev)
    if key not in pw.replicas:
        pw.replicas[key] = pw.get(name).to(devices.torch(dev), copy=True)
    return pw.replicas[key]


# ---- KV cache ------------------------------------------------------------------------------------------------------

@dataclass
class LayerCache:
    device: str
    cells: int
    k: torch.Tensor | None = None           # [Hkv, cells, Dk]
    v: torch.Tensor | None = None           # [Hkv, cells, Dv]
    latent: torch.Tensor | None = None      # MLA: [cells, kv_lora_rank + n_rot]
    cell_pos: torch.Tensor | None = None    # sliding-window ring: position held by each cell, -1 empty
    swa: bool = False


def allocate_kv(cfg: ModelConfig, inv: ModelInventory, plan: Plan, devices: Devices, dtype: torch.dtype,
                acct: Accountant, min_cells: int) -> list[LayerCache]:
    """One cache per layer on its home device (the device of blk.N.attn_norm; CPU with no_kv_offload), sized as
    llama.cpp sizes it (planner.residency.kv_cells), with at least min_cells cells for the workload. Stored in the
    compute dtype whatever type_k/type_v say."""
    knobs = plan.knobs
    out = []
    homes = home_devices(inv, plan)
    for il in range(cfg.n_layer):
        dev = "CPU" if knobs.no_kv_offload else homes[il]
        swa = bool(cfg.swa_layers[il]) and cfg.n_swa > 0
        cells = kv_cells(inv, knobs, il, plan.dialect)
        if not swa or cells >= knobs.kv_size:
            cells = max(cells, -(-min_cells // 256) * 256)
        tdev = devices.torch(dev)
        c = LayerCache(dev, cells, swa=swa)
        if cfg.is_mla:
            c.latent = torch.zeros(cells, cfg.kv_lora_rank + cfg.n_rot, dtype=dtype, device=tdev)
        else:
            hkv = cfg.n_head_kv[il]
            c.k = torch.zeros(hkv, cells, cfg.head_dim_k, dtype=dtype, device=tdev)
            c.v = torch.zeros(hkv, cells, cfg.head_dim_v, dtype=dtype, device=tdev)
        if swa:
            c.cell_pos = torch.full((cells,), -1, dtype=torch.int64, device=tdev)
        size = sum(nbytes(t) for t in (c.k, c.v, c.latent) if t is not None)
        acct.reserve(dev, size, f"KV cache of layer {il}", "kv")
        out.append(c)
    return out


# ---- uploads --------------------------------------------------------------------------------------------------------

class Stager:
    """Staging buffers on one GPU for weights uploaded from host memory, a side stream for the copies, and the
    bookkeeping. Two buffers per shape alternate, so the upload for one op can run while the previous op still
    computes on the other (the copy waits on an event recorded after that op's kernels). A logical GPU has the
    same two (its copies are synchronous, but its accountant must charge what a real GPU allocates)."""

    def __init__(self, dev: str, devices: Devices, acct: Accountant, counters: Counters) -> None:
        self.dev, self.devices, self.acct, self.counters = dev, devices, acct, counters
        self.tdev = devices.torch(dev)
        self.cuda = self.tdev.type == "cuda"
        self.slots = 2
        self.side = torch.cuda.Stream(self.tdev) if self.cuda else None
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._next: dict[tuple, int] = {}
        self._free: dict[tuple, torch.cuda.Event] = {}

    def _buffer(self, src: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        shape_key = (tuple(src.shape), src.dtype)
        slot = self._next.get(shape_key, 0)
        self._next[shape_key] = (slot + 1) % self.slots
        key = shape_key + (slot,)
        if key not in self._bufs:
            self.acct.reserve(self.dev, nbytes(src), f"upload buffer {tuple(src.shape)}", "staging")
            self._bufs[key] = torch.empty(src.shape, dtype=src.dtype, device=self.tdev)
        return key, self._bufs[key]

    def start(self, src: torch.Tensor, runs: list[tuple[int, int]] | None, model_bytes: int) -> Upload:
        """Begin copying src (whole, or the expert ranges `runs` of its first dim) into a staging buffer."""
        key, dst = self._buffer(src)
        moved = nbytes(src) if runs is None else sum(nbytes(src[a:b]) for a, b in runs)
        self.counters.upload_bytes += moved
        self.counters.upload_model_bytes += model_bytes
        self.counters.uploads += 1
        if not self.cuda:
            _copy_runs(dst, src, runs)
            return Upload(self, key, dst, None)
        if key in self._free:
            self.side.wait_event(self._free.pop(key))
        with torch.cuda.stream(self.side):
            _copy_runs(dst, src, runs)
            done = torch.cuda.Event()
            done.record(self.side)
        return Upload(self, key, dst, done)

    def release(self, key: tuple) -> None:
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.tdev))
            self._free[key] = ev


def _copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int]] | None) -> None:
    if runs is None:
        dst.copy_(src, non_blocking=True)
    else:
        for a, b in runs:
            dst[a:b].copy_(src[a:b], non_blocking=True)


@dataclass
class Upload:
    stager: Stager
    key: tuple
    dst: torch.Tensor
    done: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            torch.cuda.current_stream(self.stager.tdev).wait_event(self.done)
        return self.dst

    def release(self) -> None:
        self.stager.release(self.key)


def runs_of(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted expert ids -> maximal contiguous [a, b) ranges."""
    out: list[tuple[int, int]] = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


def model_bytes_of(inv: ModelInventory, names: Iterable[str], fraction: float = 1.0) -> int:
    return int(math.fsum(inv.by_name[n].nbytes for n in names) * fraction)
