"""What several use cases check the same way: counts, the machine, the target build, whether CUDA is here."""
from __future__ import annotations

from dataclasses import replace

from planner.builds import Build, parse_build
from planner.errors import BudgetError, InputError
from planner.hardware import HardwareProfile, fmt_bytes, parse_size, resolve


def positive(v: int, flag: str) -> int:
    if v <= 0:
        raise InputError(f"{flag} must be positive, got {v}")
    return v


def nonneg(v: int, flag: str) -> int:
    if v < 0:
        raise InputError(f"{flag} must be >= 0, got {v}")
    return v


def parse_seconds(text: str, flag: str) -> float:
    """A duration: a number with ms, s, m or h ("3s", "500ms", "1.5m", "2h"; a bare number is seconds)."""
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*", str(text), re.ASCII)
    if m is None:
        raise InputError(f"{flag} {text!r}: give a duration such as 3s, 500ms, 1.5m or 2h")
    value = float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
    if not value < float("inf"):                  # 400 digits read as inf: no limit at all
        raise InputError(f"{flag} {text[:40]!r}: a duration of finite length")
    if value <= 0:
        raise InputError(f"{flag} {text!r}: a duration above zero")
    return value


def hardware(preset: str | None, gpu: str | None, required: bool = True,
             keep_free: str | int = 0, ram: str | None = None) -> HardwareProfile | None:
    """The machine a request names (--hardware PROFILE, --gpu SIZES, or both), keeping `keep_free` (the request's
    --keep-free: plan's and tune's default is KEEP_FREE; explain, which says what llama.cpp does with the whole
    card, keeps none) free on each GPU, with `ram` of host RAM (--ram; default: a profile's own, and for --gpu alone
    this machine's, with_ram_of); None when it names none and none is required."""
    hw = resolve(preset, gpu)
    if hw is not None:
        keep = parse_size(keep_free, allow_zero=True)
        for i, g in enumerate(hw.gpus):
            if keep >= g.vram_bytes:
                raise BudgetError(f"nothing fits on CUDA{i}: --keep-free {keep_free} keeps all of its "
                                  f"{fmt_bytes(g.vram_bytes)} free; keep less free, or give the GPU's real size "
                                  "with --gpu")
        return with_ram_of(replace(hw, keep_free_bytes=keep), ram, profile=preset is not None)
    if required:
        raise InputError("say what GPUs there are: --gpu 24GiB[,24GiB] or --hardware PROFILE")
    return None


RAM_ENV = "OFFLOAD_TUNER_RAM"      # this machine's RAM as --ram's default says it, where probing is not wanted


def machine_ram_bytes() -> int | None:
    """This machine's memory (os.sysconf SC_PHYS_PAGES x SC_PAGE_SIZE), or $OFFLOAD_TUNER_RAM (a size) when set;
    None where neither says (no sysconf)."""
    import os
    if os.environ.get(RAM_ENV, "").strip():
        return parse_size(os.environ[RAM_ENV])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def with_ram_of(hw: HardwareProfile, ram: str | None, profile: bool) -> HardwareProfile:
    """`hw` with the host RAM a request gives (--ram SIZE); without one, a profile's own ram_bytes, and for a --gpu
    plan made here (no profile: the generic desktop's 128 GiB is nobody's) this machine's memory."""
    if ram is not None:
        return hw.with_ram(parse_size(ram))
    here = None if profile else machine_ram_bytes()
    return hw.with_ram(here) if here else hw


def target_build(spec: str | None, dialect: str) -> Build:
    """--build DIALECT:N, or the path of a llama.cpp program (its --help and --version say), else pinned."""
    if spec and ("/" in spec or spec.startswith(".")):
        from runtime.llamacpp_binary import build_of_binary     # runs the program: runtime/, imported here only
        build = build_of_binary(spec)
        if build.dialect != dialect:
            raise InputError(f"--build {spec} is a {build.dialect} program; say --dialect {build.dialect}")
        return build
    return parse_build(spec, dialect)


def cuda_available() -> bool:
    from runtime.gpumem import cuda_available as probe     # torch lives in runtime/, imported only there
    return probe()
