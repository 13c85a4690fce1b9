"""HardwareProfile: GPUs, host and links, as the cost and memory models see them; presets and size parsing.

Every rate is in bytes/s or FLOP/s; every size in bytes. Presets live in hardware_presets/*.json (data, with
their sources); `offload-tuner calibrate` writes the same JSON from measurements.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from .errors import InputError

GiB = 1 << 30
MiB = 1 << 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": GiB, "gb": 10**9, "gib": GiB, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, allow_zero: bool = False) -> int:
    """'24GiB', '24G' (binary, as llama.cpp and nvidia-smi mean it), '24576MiB', '24GB' (decimal), '24000000000';
    0 only with allow_zero (a margin may be none, a GPU may not)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise InputError(f"bad size {text!r}: use e.g. 24GiB, 24G, 24576MiB or a number of bytes")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"bad size {text!r}: must be {'>= 0' if allow_zero else 'positive'}")
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


@dataclass(frozen=True)
class Host:
    ram_bytes: int
    mem_bw: float              # bytes/s, effective for quantized GEMV on all threads
    flops: float               # FLOP/s, quantized GEMM on all threads
    n_threads: int = 8


@dataclass(frozen=True)
class Link:
    h2d_pinned: float          # bytes/s
    h2d_pageable: float
    d2d: float = 0.0           # GPU <-> GPU (0: through host)


@dataclass(frozen=True)
class Overheads:
    """Fixed costs the cost model adds; calibration replaces them."""
    per_split_s: float = 25e-6      # a backend switch (sync + activation copy) per token
    per_layer_gpu_s: float = 12e-6  # kernel launches of one layer on the GPU per token (graphs amortise)
    per_layer_cpu_s: float = 20e-6  # thread sync of one layer on the CPU per token
    gpu_eff: float = 0.80           # fraction of GPU mem_bw reached by decode kernels
    cpu_eff: float = 0.70           # fraction of host mem_bw reached by CPU decode


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpus: tuple[GPU, ...]
    host: Host
    link: Link
    overheads: Overheads = field(default_factory=Overheads)
    source: str = ""

    def gpu(self, device: str) -> GPU:
        return self.gpus[int(device[4:])]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        try:
            return cls(name=d["name"], gpus=tuple(GPU(**g) for g in d["gpus"]), host=Host(**d["host"]),
                       link=Link(**d["link"]), overheads=Overheads(**d.get("overheads", {})),
                       source=d.get("source", ""))
        except (KeyError, TypeError) as e:
            raise InputError(f"bad hardware profile: {e}") from e

    def with_vram(self, sizes: list[int]) -> "HardwareProfile":
        """Same machine, GPUs resized (and repeated or cut to len(sizes))."""
        base = self.gpus[0]
        gpus = tuple(replace(self.gpus[i] if i < len(self.gpus) else base, vram_bytes=s) for i, s in enumerate(sizes))
        return replace(self, gpus=gpus)


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("planner").joinpath("hardware_presets").iterdir()
                  if p.name.endswith(".json"))


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A preset name (see preset_names()) or a JSON file written by `offload-tuner calibrate`."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        try:
            return HardwareProfile.from_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"cannot read hardware profile {name_or_path}: {e}") from e
    res = resources.files("planner").joinpath(f"hardware_presets/{name_or_path}.json")
    if not res.is_file():
        raise InputError(f"unknown hardware preset {name_or_path!r}; known: {', '.join(preset_names())}")
    return HardwareProfile.from_dict(json.loads(res.read_text()))


def from_gpu_sizes(sizes: str) -> HardwareProfile:
    """`--gpu 24GiB[,24GiB]` alone: a generic desktop (dual-channel DDR5, PCIe 4.0) with GPUs of those sizes."""
    parsed = [parse_size(s) for s in sizes.split(",") if s.strip()]
    if not parsed:
        raise InputError(f"bad --gpu {sizes!r}: give one size per GPU, e.g. 24GiB or 24GiB,16GiB")
    return replace(load_hardware("desktop-ddr5").with_vram(parsed), name=f"desktop-ddr5 {sizes}")
