"""ggml's scheduling rules in PyTorch: where each op runs, the copies between devices, and the executors.

Rules (ggml-backend.cpp ggml_backend_sched_backend_id_from_cur; docs/llamacpp.md section 4):
- an op with a weight runs on the device holding the weight;
- except that an op whose weight lives in host memory runs on the first GPU (the weight uploaded into a
  staging buffer) when its batch reaches the plan's offload threshold for that op class
  (planner.residency.offload_min_batch: dense_matmul / moe_matmul / output, ik's n_expert/n_expert_used factor);
  1-D weights (norms, biases) follow the dense_matmul rule like ggml's MUL/ADD with a host weight; GET_ROWS
  (token_embd) never moves;
- attention runs where its layer's KV cache lives; weightless glue runs on the layer's home device.

A forward pass is a Program: ops that read and write named activations. The builder inserts a copy wherever
an op reads an activation produced on another device (ggml's split inputs), so activations cross devices only
at segment boundaries. The eager executor runs the ops in order. On CUDA, decode steps run as CUDA graphs:
each maximal run of GPU ops is captured once and replayed, with the host-side ops (CPU experts, the embedding)
in between and the boundary copies through fixed page-locked buffers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch

from planner.residency import offload_min_batch
from planner.model import ModelInventory
from planner.plan import Plan

from .placement import Accountant, Counters, Devices, is_gpu, nbytes

OpFn = Callable[..., Any]


@dataclass
class Op:
    name: str
    device: str                 # where it runs
    kind: str                   # op class: dense_matmul, moe_matmul, output, norm, attention, get_rows, glue, transfer
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    fn: OpFn
    offloaded: bool = False     # a host weight uploaded to a GPU for this op
    host_sync: bool = False     # reads device values on the host (cannot be captured in a CUDA graph)
    src: str = ""               # transfers: the source device
    shape: tuple = ()           # transfers: (shape, dtype) of what the last run moved
    scratch: int = 0            # bytes the op holds inside on a real GPU beyond its inputs and output (its kernels'
    #                             temporaries: the grouped experts' sorted rows and products); charged in dry runs


# ---- offload decisions -----------------------------------------------------------------------------------------------

class OffloadRules:
    def __init__(self, inv: ModelInventory, plan: Plan, devices: Devices, device_of: dict[str, str]) -> None:
        self.inv, self.plan, self.devices, self.device_of = inv, plan, devices, device_of

    def threshold(self, name: str, op_class: str | None = None) -> int | None:
        """Batch from which an op on host weight `name` runs on the first GPU; None: never."""
        knobs = self.plan.knobs
        if op_class == "output":
            rule = knobs.offload.rule("output")
            return rule.min_batch if rule.enabled and not knobs.rtr else None
        t = self.inv.by_name[name]
        if len(t.shape) < 2 and t.role != "token_embd":
            rule = knobs.offload.rule("dense_matmul")
            return rule.min_batch if rule.enabled and not knobs.rtr else None
        return offload_min_batch(self.inv, self.plan, t)

    def run_device(self, name: str, batch: int, op_class: str | None = None, weight_device: str | None = None) -> str:
        dev = weight_device or self.device_of[name]
        target = self.devices.offload_target
        if is_gpu(dev) or target is None:
            return dev
        thr = self.threshold(name, op_class)
        return target if thr is not None and batch >= thr else dev


# ---- programs --------------------------------------------------------------------------------------------------------

@dataclass
class Program:
    ops: list[Op]
    free_after: list[tuple[str, ...]]          # activations dead after op i
    device_inputs: dict[str, list[str]]        # external key -> devices it is read on (key@dev filled by the caller)
    outputs: dict[str, str]                    # output -> the name its value has in the state
    key_device: dict[str, str]                 # activation -> device it lives on
    graphs: GraphRunner | None = None
    per_run: Counters | None = None            # counters of one run (for graph replays)
    graph_failed: str = ""                     # why capturing it failed (then it runs eagerly)

    @property
    def host_sync(self) -> bool:
        return any(op.host_sync for op in self.ops)

    @property
    def graphable(self) -> bool:
        """No op reads device values on the host, none uploads weights (the side-stream copies and their
        events stay out of graphs), and no earlier capture failed."""
        return not self.graph_failed and not any(op.host_sync or op.offloaded for op in self.ops)


class ProgramBuilder:
    """Ops in order. Activations are named by the model ("x", "3.hn"); each write gets its own name here
    ("x", "x#12", ...), so every name is written once (a captured segment reads exactly the tensor the eager run
    had at that point), and a read on another device than the writer's adds one copy op ("x#12@CUDA0")."""

    def __init__(self, devices: Devices, counters: Counters, per_device_inputs: tuple[str, ...] = ()) -> None:
        self.devices, self.counters = devices, counters
        self.ops: list[Op] = []
        self.current: dict[str, str] = {}          # model name -> name of its latest write
        self.loc: dict[str, str] = {}              # written name -> device
        self.copies: dict[str, dict[str, str]] = {}
        self.per_device = set(per_device_inputs)
        self.device_inputs: dict[str, list[str]] = {}
        self.externals: set[str] = set()

    def external(self, key: str, device: str) -> None:
        self.externals.add(key)
        self.current[key] = key
        self.loc[key] = device
        self.copies[key] = {device: key}

    def on(self, key: str, device: str) -> str:
        """The name of activation `key` on `device`, adding the copy if it lives elsewhere."""
        if key in self.per_device:
            devs = self.device_inputs.setdefault(key, [])
            if device not in devs:
                devs.append(device)
            return f"{key}@{device}"
        name = self.current[key]
        copies = self.copies[name]
        if device not in copies:
            src = self.loc[name]
            moved = f"{name}@{device}"
            self.ops.append(Op(f"copy {name} {src}->{device}", device, "transfer", (copies[src],), (moved,),
                               self._mover(src, device), src=src))
            copies[device] = moved
        return copies[device]

    def _mover(self, src: str, dst: str) -> OpFn:
        target = self.devices.torch(dst)
        counters = self.counters
        blocking = self.devices.torch(src).type == "cuda" and target.type == "cpu"

        def move(t: torch.Tensor) -> torch.Tensor:
            counters.transfer_bytes += nbytes(t)
            counters.transfers += 1
            return t.to(target, non_blocking=not blocking)
        return move

    def add(self, name: str, device: str, kind: str, reads: tuple[str, ...], writes: tuple[str, ...], fn: OpFn,
            offloaded: bool = False, host_sync: bool = False, scratch: int = 0) -> None:
        resolved = tuple(self.on(k, device) for k in reads)
        written = []
        for w in writes:
            unique = w if w not in self.current else f"{w}#{len(self.ops)}"
            self.current[w] = unique
            self.loc[unique] = device
            self.copies[unique] = {device: unique}
            written.append(unique)
        self.ops.append(Op(name, device, kind, resolved, tuple(written), fn, offloaded, host_sync, scratch=scratch))

    def finish(self, outputs: tuple[str, ...]) -> Program:
        names = {o: self.current[o] for o in outputs}
        last: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for k in op.reads + op.writes:
                last[k] = i
        keep = set(names.values()) | self.externals
        free: list[list[str]] = [[] for _ in self.ops]
        for k, i in last.items():
            if k not in keep and k.split("@")[0] not in self.per_device:
                free[i].append(k)
        key_device = {}
        for op in self.ops:
            for w in op.writes:
                key_device[w] = op.device
        return Program(self.ops, [tuple(f) for f in free], self.device_inputs, names, key_device)


# ---- eager execution -------------------------------------------------------------------------------------------------

def _count(counters: Counters, op: Op) -> None:
    counters.ops[f"{op.kind}@{op.device}"] += 1
    if op.offloaded:
        counters.offloaded[op.kind] += 1


def _apply(op: Op, state: dict[str, Any]) -> None:
    args = [state[k] for k in op.reads]
    if op.kind == "transfer":
        op.shape = (tuple(args[0].shape), args[0].dtype)
    out = op.fn(*args)
    if len(op.writes) == 1:
        state[op.writes[0]] = out
    else:
        for k, v in zip(op.writes, out):
            state[k] = v


def run_eager(program: Program, state: dict[str, Any], counters: Counters, acct: Accountant | None = None,
              free: bool = True, scratch: bool = False) -> None:
    """Run every op in order. With `acct` (logical GPUs), report the live activations per device after each op;
    with `scratch` (a dry run predicting real GPUs) also each op's scratch on top of what is live as it ends
    (its inputs and output)."""
    for i, op in enumerate(program.ops):
        _apply(op, state)
        _count(counters, op)
        if acct is not None and scratch and op.scratch:
            _observe(program, state, acct, {op.device: op.scratch})
        if free:
            for k in program.free_after[i]:
                state.pop(k, None)
        if acct is not None:
            _observe(program, state, acct)


def _observe(program: Program, state: dict[str, Any], acct: Accountant, extra: dict[str, int] | None = None
             ) -> None:
    live: dict[str, int] = dict(extra or {})
    seen: set[int] = set()
    for k, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        dev = program.key_device.get(k) or (k.rsplit("@", 1)[1] if "@" in k else "CPU")
        storage = t.untyped_storage()
        ident = storage._cdata          # the storage itself (views share it); also on the meta device (dry runs)
        if ident in seen:
            continue
        seen.add(ident)
        live[dev] = live.get(dev, 0) + storage.nbytes()
    for dev, n in live.items():
        if dev in acct.devices.budgets:
            acct.observe(dev, n)


# ---- CUDA graphs -----------------------------------------------------------------------------------------------------

@dataclass
class Segment:
    device: str                   # plan device; GPU segments are captured
    ops: list[Op]
    graph: torch.cuda.CUDAGraph | None = None
    host_inputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)   # (cpu key, pinned buffer) to fill
    ends_on_host: bool = False    # a later host segment reads its results: synchronize after replay


def _segment_device(op: Op) -> str:
    if op.kind == "transfer" and not is_gpu(op.device):
        return op.src          # a device -> host copy belongs to the GPU run before it
    return op.device


class GraphRunner:
    """A program as CUDA graphs: each GPU segment captured once (after an eager warm-up run), then replayed,
    with the host segments run in between. Used for decode steps and for prompt ubatches without uploads."""

    def __init__(self, program: Program, devices: Devices) -> None:
        self.program, self.devices = program, devices
        self.segments: list[Segment] = []
        for op in program.ops:
            dev = _segment_device(op)
            if not self.segments or self.segments[-1].device != dev:
                self.segments.append(Segment(dev, []))
            self.segments[-1].ops.append(op)
        for i, seg in enumerate(self.segments):
            seg.ends_on_host = is_gpu(seg.device) and any(not is_gpu(s.device) for s in self.segments[i + 1:])
        self.pools: dict[str, Any] = {}
        # host segments after a GPU segment read its results (through device -> host copies)
        self.needs_warm_state = any(not is_gpu(s.device) for s in self.segments[1:]) and any(
            is_gpu(s.device) for s in self.segments)

    def capture(self, state: dict[str, Any]) -> None:
        """Capture every GPU segment in order. Host segments before the first GPU segment run for real (they
        read only external inputs); later ones are not run, so `state` must then hold every activation of a
        finished eager run (warm-up with free=False). Activations dead after an op are freed during the
        capture, so the graphs' memory pool reuses them as the eager run's allocator would."""
        free_after = {id(op): keys for op, keys in zip(self.program.ops, self.program.free_after)}
        seen_gpu = False
        for seg in self.segments:
            if not is_gpu(seg.device):
                if not seen_gpu:
                    for op in seg.ops:
                        _apply(op, state)
                continue
            seen_gpu = True
            tdev = self.devices.torch(seg.device)
            pool = self.pools.setdefault(seg.device, torch.cuda.graph_pool_handle())
            fns = [self._graph_fn(op, seg) for op in seg.ops]
            torch.cuda.synchronize(tdev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(tdev), torch.cuda.graph(graph, pool=pool):
                for op, fn in zip(seg.ops, fns):
                    out = fn(*[state[k] for k in op.reads])
                    if len(op.writes) == 1:
                        state[op.writes[0]] = out
                    else:
                        for k, v in zip(op.writes, out):
                            state[k] = v
                    for k in free_after[id(op)]:
                        if is_gpu(self.program.key_device.get(k, "CPU")) and not self.needs_warm_state:
                            state.pop(k, None)
            seg.graph = graph

    def _graph_fn(self, op: Op, seg: Segment) -> OpFn:
        if op.kind != "transfer":
            return op.fn
        shape, dtype = op.shape                   # recorded by the warm-up run
        dst = self.devices.torch(op.device)
        if not is_gpu(op.src):                    # host -> GPU: from a fixed page-locked buffer the host fills
            pinned = torch.empty(shape, dtype=dtype, pin_memory=True)
            seg.host_inputs.append((op.reads[0], pinned))
            return lambda t: pinned.to(dst, non_blocking=True)
        if not is_gpu(op.device):                 # GPU -> host: into a fixed page-locked buffer
            pinned = torch.empty(shape, dtype=dtype, pin_memory=True)

            def d2h(t: torch.Tensor) -> torch.Tensor:
                pinned.copy_(t, non_blocking=True)
                return pinned
            return d2h
        return lambda t: t.to(dst, non_blocking=True)

    def replay(self, state: dict[str, Any]) -> None:
        for seg in self.segments:
            if seg.graph is None:
                for op in seg.ops:
                    _apply(op, state)
                continue
            for key, pinned in seg.host_inputs:
                pinned.copy_(state[key])
            seg.graph.replay()
            if seg.ends_on_host:
                torch.cuda.current_stream(self.devices.torch(seg.device)).synchronize()


def synchronize(devices: Devices) -> None:
    if devices.cuda:
        for g in devices.gpus:
            torch.cuda.synchronize(devices.torch(g))


def now(devices: Devices) -> float:
    """A clock read after every device has finished its queued work."""
    synchronize(devices)
    return time.perf_counter()
