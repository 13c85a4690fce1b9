"""HardwareProfile: GPUs, host and links, as the cost and memory models see them; presets and size parsing.

Every rate is in bytes/s or FLOP/s; every size in bytes. Presets live in hardware_presets/*.json (data, with
their sources); `offload-tuner calibrate` writes the same JSON from measurements.
"""
from __future__ import annotations

import json
import math
import re
from functools import cache
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from .errors import InputError
from .files import PROFILE_BYTES, read_text

GiB = 1 << 30
MiB = 1 << 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": GiB, "gb": 10**9, "gib": GiB, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
# ASCII digits and spaces only (the service's schema says the same: offload_tuner/service/bodies.py SIZE)
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", re.ASCII)


MAX_SIZE = 1 << 50            # 1 PiB: far above any GPU or host memory; a larger "size" is a typo

# GPU memory every command keeps free on each GPU (--keep-free): the display, other processes and the driver's
# own allocations live there. The same value as llama.cpp's own fit keeps free by default (-fitt/--fit-target,
# 1024 MiB: common/arg.cpp; planner/flags/interpret.py FIT_TARGET_MIB), so a pick and llama.cpp's --fit are held to
# the same room. A HardwareProfile built in code keeps none unless told (keep_free_bytes=0): the commands and the
# service set it (offload_tuner/app/common.py hardware).
KEEP_FREE = 1024 * MiB


def kept_free_text(keep_free_bytes: int) -> str:
    """How every report says it: 'kept free: 1024 MiB' (per GPU)."""
    return f"kept free: {keep_free_bytes / MiB:.0f} MiB"


def parse_size(text: str | int, allow_zero: bool = False) -> int:
    """'24GiB', '24G' (binary, as llama.cpp and nvidia-smi mean it), '24576MiB', '24GB' (decimal), '24000000000'.
    Whole bytes from 1 (0 with allow_zero: a margin may be none, a GPU may not) to 1 PiB."""
    if isinstance(text, bool):
        raise InputError(f"bad size {text!r}: use e.g. 24GiB, 24G, 24576MiB or a number of bytes")
    m = None if isinstance(text, int) else _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if not isinstance(text, int) and (m is None or unit not in _UNITS):
        raise InputError(f"bad size {str(text)[:60]!r}: use e.g. 24GiB, 24G, 24576MiB or a number of bytes")
    value = text if isinstance(text, int) else float(m.group(1)) * _UNITS[unit]   # type: ignore[union-attr]
    if value > MAX_SIZE:
        raise InputError(f"bad size {str(text)[:60]!r}: more than 1 PiB")
    if value != int(value) or value < (0 if allow_zero else 1):
        what = "a whole number of bytes, >= 0" if allow_zero else "a whole number of bytes, at least 1"
        raise InputError(f"bad size {str(text)[:60]!r}: must be {what}")
    return int(value)


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class GPU:
    name: str
    vram_bytes: int
    mem_bw: float              # bytes/s, effective for quantized GEMV (what decode reads at)
    flops: float               # FLOP/s, effective for quantized GEMM in prompt processing
    overhead_bytes: int = 600 * MiB   # CUDA context + cuBLAS, not seen by llama.cpp's allocator (ref. section 6)
    n_sm: int = 0              # streaming multiprocessors (0: unknown); ik's flash attention sizes a temporary by it


# What a plan's weights in RAM are read at once they outgrow it: mmap'd pages the page cache cannot hold come back
# from the model's file on every token. 3 GB/s: a PCIe 3.0 x4 / entry PCIe 4.0 NVMe SSD's sequential read (a SATA
# SSD reads ~0.5 GB/s, a fast PCIe 4.0 one ~7); a profile says its own with host.disk_read_bytes_per_s.
DEFAULT_DISK_READ = 3e9


@dataclass(frozen=True)
class Host:
    ram_bytes: int
    mem_bw: float              # bytes/s, effective for quantized GEMV on all threads
    flops: float               # FLOP/s, quantized GEMM on all threads
    n_threads: int = 8
    disk_read_bytes_per_s: float = DEFAULT_DISK_READ   # where weights that do not fit in RAM are read from


@dataclass(frozen=True)
class Link:
    h2d_pinned: float          # bytes/s
    h2d_pageable: float
    d2d: float = 0.0           # GPU <-> GPU (0: through host)
    copy_call_s: float = 6e-6  # fixed cost of one host -> GPU cudaMemcpyAsync (a small pinned copy)


@dataclass(frozen=True)
class Overheads:
    """Fixed costs (calibrate measures them) and the share of each ceiling llama.cpp's kernels reach. A
    calibrated profile holds PyTorch's ceilings and LLAMACPP_SHARES (calibrate cannot run llama.cpp's kernels);
    the spec-sheet presets give effective rates, so their GEMM shares stay 1."""
    per_split_s: float = 25e-6      # a GPU -> CPU -> GPU round trip (activation copies + synchronisation)
    per_layer_gpu_s: float = 12e-6  # kernel launches of one layer on the GPU per token (graphs amortise)
    per_layer_cpu_s: float = 20e-6  # thread-pool work of one layer's CPU ops per token
    gpu_eff: float = 0.80           # fraction of GPU mem_bw reached by decode kernels
    cpu_eff: float = 0.70           # fraction of host mem_bw reached by CPU decode
    launch_s: float = 5e-6          # one GPU kernel launch outside a CUDA graph (prompt ubatches)
    sync_s: float = 20e-6           # a small GPU -> host read-back and stream synchronisation
    gpu_gemm_eff: float = 1.0       # fraction of the GPU's GEMM FLOP/s llama.cpp's quantized GEMMs reach
    cpu_gemm_eff: float = 1.0       # fraction of the host's GEMM FLOP/s ggml's CPU quantized GEMMs reach


# Shares of calibrate's PyTorch ceilings (bf16 GEMV/GEMM, HardwareProfile's mem_bw and flops) that llama.cpp
# reached on the GPU box (H100 + 16-core Xeon; Q4_0 weights; MMVQ/MMQ on the GPU, ggml's vec-dot kernels on the
# CPU), fitted on the even lines of tests/planner/data/h100_llamacpp_runs.jsonl together with the 17 runs of
# benchmarks/reported/llamacpp_gpu_h100_runs.jsonl (all-GPU and whole layers on the CPU, which the shared file
# lacks): benchmarks/cost_model.py --fit --fit-also; held-out figures in docs/cost_model.md. calibrate writes them
# into every profile it measures.
LLAMACPP_SHARES: dict[str, float] = {"gpu_eff": 0.4363, "cpu_eff": 0.3684, "gpu_gemm_eff": 0.1213,
                                     "cpu_gemm_eff": 0.0851}


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpus: tuple[GPU, ...]
    host: Host
    link: Link
    overheads: Overheads = field(default_factory=Overheads)
    source: str = ""
    keep_free_bytes: int = 0       # GPU memory kept free on each GPU: no plan may use it (KEEP_FREE by default)

    def gpu(self, device: str) -> GPU:
        from .plan import gpu_index      # plan.py names devices; hardware.py does not import it at load
        return self.gpus[gpu_index(device)]

    def to_dict(self) -> dict:
        """The profile as its JSON holds it (keep_free_bytes is a command's choice, not the machine's: left out)."""
        d = asdict(self)
        del d["keep_free_bytes"]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "hardware profile") -> HardwareProfile:
        """A profile from JSON, every field checked against the dataclasses' fields (the message names the field)."""
        _check_schema(d, where)
        return cls(name=d["name"], gpus=tuple(GPU(**g) for g in d["gpus"]), host=Host(**d["host"]),
                   link=Link(**d["link"]), overheads=Overheads(**d.get("overheads", {})), source=d.get("source", ""))

    def with_vram(self, sizes: list[int]) -> HardwareProfile:
        """Same machine, GPUs resized (and repeated or cut to len(sizes)). A profile without GPUs (calibrated on
        a machine without one) gets generic GPUs of those sizes, and generic link rates where it has none."""
        if not self.gpus:
            generic = load_hardware(GENERIC)
            link = self.link if self.link.h2d_pinned > 0 and self.link.h2d_pageable > 0 else generic.link
            gpus = tuple(replace(generic.gpus[0], vram_bytes=s) for s in sizes)
            return replace(self, gpus=gpus, link=link,
                           name=f"{self.name} + generic GPU ({GENERIC} preset: the profile has no GPU)")
        base = self.gpus[0]
        gpus = tuple(replace(self.gpus[i] if i < len(self.gpus) else base, vram_bytes=s) for i, s in enumerate(sizes))
        return replace(self, gpus=gpus)

    def with_ram(self, ram_bytes: int) -> HardwareProfile:
        """Same machine, host RAM `ram_bytes` (--ram)."""
        return replace(self, host=replace(self.host, ram_bytes=ram_bytes))


GENERIC = "desktop-ddr5"         # the preset whose GPU and link stand in for ones a profile lacks

# The JSON schema is the dataclasses' own fields (GPU, Host, Link, Overheads): a field without a default is
# required; numbers must be finite and >= 0, and > 0 where a zero would divide (POSITIVE).
POSITIVE = frozenset({"vram_bytes", "mem_bw", "flops", "ram_bytes", "n_threads", "gpu_eff", "cpu_eff",
                      "disk_read_bytes_per_s"})
MAX_GPUS = 16                    # llama_max_devices()


def _sections() -> dict[str, type]:
    return {"gpu": GPU, "host": Host, "link": Link, "overheads": Overheads}


def _check_section(obj: object, kind: str, path: str, where: str) -> None:
    import dataclasses as dc
    if not isinstance(obj, dict):
        raise InputError(f"bad {where}: {path} is {type(obj).__name__}, expected an object")
    fields = {f.name: f for f in dc.fields(_sections()[kind])}
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise InputError(f"bad {where}: {path}.{unknown[0]} is not a field (known: {', '.join(fields)})")
    for name, f in fields.items():
        if name not in obj:
            if f.default is dc.MISSING and f.default_factory is dc.MISSING:   # type: ignore[misc]
                raise InputError(f"bad {where}: {path}.{name} is missing")
            continue
        v, kind_of = obj[name], str(f.type)
        if kind_of == "str":
            if not isinstance(v, str):
                raise InputError(f"bad {where}: {path}.{name} is {str(v)[:40]!r}, expected a string")
            continue
        want = (int,) if kind_of == "int" else (int, float)
        if isinstance(v, bool) or not isinstance(v, want):
            raise InputError(f"bad {where}: {path}.{name} is {str(v)[:40]!r}, expected "
                             f"{'an integer' if want == (int,) else 'a number'}")
        strict = name in POSITIVE
        if not math.isfinite(v) or v < 0 or (strict and v == 0):
            raise InputError(f"bad {where}: {path}.{name} is {v!r}, expected a finite number "
                             f"{'> 0' if strict else '>= 0'}")


def _check_schema(d: object, where: str) -> None:
    if not isinstance(d, dict):
        raise InputError(f"bad {where}: expected a JSON object with name, gpus, host, link")
    for key in ("name", "gpus", "host", "link"):
        if key not in d:
            raise InputError(f"bad {where}: field {key!r} is missing")
    if not isinstance(d["name"], str):
        raise InputError(f"bad {where}: name is {str(d['name'])[:40]!r}, expected a string")
    if not isinstance(d["gpus"], list) or len(d["gpus"]) > MAX_GPUS:
        raise InputError(f"bad {where}: gpus must be a list of at most {MAX_GPUS} GPUs")
    for i, g in enumerate(d["gpus"]):
        _check_section(g, "gpu", f"gpus[{i}]", where)
    _check_section(d["host"], "host", "host", where)
    _check_section(d["link"], "link", "link", where)
    if "overheads" in d:
        _check_section(d["overheads"], "overheads", "overheads", where)
    if "source" in d and not isinstance(d["source"], str):
        raise InputError(f"bad {where}: source must be a string")


def resolve(hardware: str | None, gpu: str | None) -> HardwareProfile | None:
    """--hardware and/or --gpu as the CLI takes them; None when neither is given. A profile without GPUs needs
    --gpu (it then gets generic GPUs of those sizes)."""
    if hardware:
        hw = load_hardware(hardware)
        if gpu:
            return hw.with_vram(_gpu_sizes(gpu))
        if not hw.gpus:
            raise InputError(f"hardware profile {hardware} has no GPU (calibrated on a machine without one): add "
                             "--gpu SIZE[,SIZE..] to plan for GPUs of those sizes")
        if hw.link.h2d_pinned <= 0 or hw.link.h2d_pageable <= 0:
            return replace(hw, link=load_hardware(GENERIC).link, name=f"{hw.name} + generic PCIe link ({GENERIC})")
        return hw
    if gpu:
        return from_gpu_sizes(gpu)
    return None


BARE_BYTES_MAX = 1 << 20      # a unitless --gpu size under this is a forgotten unit (bytes of no GPU), not bytes


def _gpu_sizes(sizes: str) -> list[int]:
    parts = [s.strip() for s in sizes.split(",")]
    given = [s for s in parts if s]
    if given and len(given) != len(parts):       # "24GiB," or "24GiB,,16GiB": a size left out, or a stray comma
        raise InputError(f"bad --gpu {sizes[:60]!r}: an empty size between commas; did you mean "
                         f"--gpu {','.join(given)[:60]}?")
    for s in given:
        if s.isdigit() and int(s) < BARE_BYTES_MAX:
            raise InputError(f"bad --gpu {s[:20]}: a size without a unit is bytes ({s} B is no GPU); did you mean "
                             f"--gpu {s}GiB?")
    parsed = [parse_size(s) for s in given]
    if not parsed or len(parsed) > MAX_GPUS:
        raise InputError(f"bad --gpu {sizes[:60]!r}: give one size per GPU (1 to {MAX_GPUS}), "
                         "e.g. 24GiB or 24GiB,16GiB")
    return parsed


@cache
def _preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.name[:-5] for p in resources.files("planner").joinpath("hardware_presets").iterdir()
                        if p.name.endswith(".json")))


def preset_names() -> list[str]:
    return list(_preset_names())


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A preset name (see preset_names()) or a JSON file written by `offload-tuner calibrate`."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        try:
            data = json.loads(read_text(path, "hardware profile", PROFILE_BYTES))
        except (json.JSONDecodeError, RecursionError) as e:
            raise InputError(f"hardware profile {name_or_path} is not JSON: {str(e)[:100]}") from e
        return HardwareProfile.from_dict(data, f"hardware profile {name_or_path}")
    if name_or_path not in preset_names():
        raise InputError(f"unknown hardware preset {name_or_path!r}; known: {', '.join(preset_names())}")
    return _preset(name_or_path)


@cache
def _preset(name: str) -> HardwareProfile:
    """A preset of the package: read once (the service plans on them many times a second)."""
    return HardwareProfile.from_dict(json.loads(resources.files("planner").joinpath(f"hardware_presets/{name}.json")
                                                .read_text()))


def from_gpu_sizes(sizes: str) -> HardwareProfile:
    """`--gpu 24GiB[,24GiB]` alone: a generic desktop (dual-channel DDR5, PCIe 4.0) with GPUs of those sizes."""
    parsed = _gpu_sizes(sizes)
    return replace(load_hardware(GENERIC).with_vram(parsed), name=f"{GENERIC} {sizes}")
