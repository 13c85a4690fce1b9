"""What several use cases check the same way: counts, the machine, the target build, whether CUDA is here."""
from __future__ import annotations

from .. import engines
from ..builds import Build, parse_build
from ..errors import InputError
from ..hardware import HardwareProfile, resolve


def positive(v: int, flag: str) -> int:
    if v <= 0:
        raise InputError(f"{flag} must be positive, got {v}")
    return v


def nonneg(v: int, flag: str) -> int:
    if v < 0:
        raise InputError(f"{flag} must be >= 0, got {v}")
    return v


def parse_seconds(text: str, flag: str) -> float:
    """A duration: a number with s, ms or m ("3s", "500ms", "1.5m"; a bare number is seconds)."""
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m)?\s*", str(text), re.ASCII)
    if m is None:
        raise InputError(f"{flag} {text!r}: give a duration such as 3s, 500ms or 1.5m")
    value = float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    if value <= 0:
        raise InputError(f"{flag} {text!r}: a duration above zero")
    return value


def hardware(preset: str | None, gpu: str | None, required: bool = True) -> HardwareProfile | None:
    """The machine a request names (--hardware PROFILE, --gpu SIZES, or both); None when it names none and
    none is required."""
    hw = resolve(preset, gpu)
    if hw is not None:
        return hw
    if required:
        raise InputError("say what GPUs there are: --gpu 24GiB[,24GiB] or --hardware PROFILE")
    return None


def target_build(spec: str | None, dialect: str) -> Build:
    """--build DIALECT:N, or the path of a llama.cpp program (its --help and --version say), else pinned."""
    if spec and ("/" in spec or spec.startswith(".")):
        build = engines.runtime("build_of_binary")(spec)    # the runtime, reached by name
        if build.dialect != dialect:
            raise InputError(f"--build {spec} is a {build.dialect} program; say --dialect {build.dialect}")
        return build
    return parse_build(spec, dialect)


def cuda_available() -> bool:
    return engines.runtime("cuda_available")()   # torch lives in runtime/, imported only there
