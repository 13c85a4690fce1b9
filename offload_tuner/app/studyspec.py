"""Study specs: a study as a TOML file (studies/NAME.toml) that `tune --spec` starts or resumes.

    model = "preset:Qwen3-30B-A3B:Q4_K_M"   # or a .gguf path (relative paths: from the spec's folder)
    engine = "sim"                           # sim, torch, llamacpp
    hardware = "rtx4090-ddr5"                # preset or calibrated JSON (optional with gpu)
    gpu = "16GiB"                            # memory per GPU: "24GiB" or ["24GiB", "24GiB"] (tune --gpu; the
                                             # older key `budget` is read the same)
    objective = "both"                       # time (the default), tg, pp, both or an expression
    ctx = 8192
    n_trials = 60
    # study = "NAME"  (default: the file's stem); storage = "sqlite:///x.db" (default: NAME.db beside the spec)
    # with objective "time": workload = "agent", the requests it answers (a preset, a .toml or a .jsonl request
    # log; tune --workload; relative paths from the spec's folder), in place of the [bench] table below

    [bench]                      # the benchmark run itself (tune --n-prompt ...; `[workload]`, its older name,
                                 # is read the same)
    n_prompt = 2048
    n_gen = 128
    depth = 0
    reps = 1

    [space]
    mode = "full"                # settled or full (tune --space)
    kv_types = ["f16", "q8_0"]
    ubatch = [512, 1024, 2048]   # limits: any SpaceConfig choice list (tuner/space.py)

load_spec returns TuneRequest's fields (offload_tuner/app/requests.py); flags given on the command line override them
(TuneRequest.from_values).
A key the file should not have, or a value that is not one, is one InputError naming the key and the file.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner import defaults as D
from planner.engine_registry import names as engine_names
from planner.errors import InputError
from planner.files import SPEC_BYTES, read_text
from planner.plan import DIALECTS, KV_TYPES

if sys.version_info >= (3, 11):
    import tomllib
else:                                  # Python 3.10: the same parser, from PyPI (pyproject's dependency)
    import tomli as tomllib


class _Bad(Exception):
    """A value that is not one; the loader adds the key and the file."""


def _int(lo: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise _Bad(f"must be an integer >= {lo}, got {v!r}")
        return v
    return check


def _float_pos(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise _Bad(f"must be a number of seconds > 0, got {v!r}")
    return float(v)


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _Bad(f"must be a non-empty string, got {v!r}")
    return v.strip()


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"must be true or false, got {v!r}")
    return v


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in options:
            raise _Bad(f"must be one of {', '.join(options)}, got {v!r}")
        return v
    return check


def _wrap(check: Callable[[str], Any]) -> Callable[[Any], str]:
    """A string checked by the parser the CLI uses for the same flag (its InputError becomes the reason)."""
    def run(v: Any) -> str:
        s = _str(v)
        try:
            check(s)
        except InputError as e:
            raise _Bad(str(e)) from e
        return s
    return run


def _objective(s: str) -> None:
    from tuner.objectives import parse_objective
    parse_objective(s)


def _margin(s: str) -> None:
    from planner.hardware import parse_size
    if s.lower() != "auto":
        parse_size(s, allow_zero=True)


def _size(s: str) -> None:
    from planner.hardware import parse_size
    parse_size(s, allow_zero=True)


def _gpu_sizes(v: Any) -> str:
    from planner.hardware import MAX_GPUS, parse_size
    sizes = v.split(",") if isinstance(v, str) else v
    if not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_GPUS or not all(isinstance(s, str) for s in sizes):
        raise _Bad(f"must be a size per GPU, \"24GiB\" or [\"24GiB\", \"16GiB\"] (1 to {MAX_GPUS}), got {v!r}")
    try:
        for s in sizes:
            parse_size(s)
    except InputError as e:
        raise _Bad(str(e)) from e
    return ",".join(s.strip() for s in sizes)


def _choices(elem: Callable[[Any], Any], sort: bool = False) -> Callable[[Any], tuple[Any, ...]]:
    """A non-empty list of choices for one space dimension (duplicates dropped; sorted where the space wants)."""
    def check(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, list) or not v:
            raise _Bad(f"must be a non-empty list, got {v!r}")
        out = tuple(dict.fromkeys(elem(x) for x in v))
        return tuple(sorted(out)) if sort else out
    return check


def _pow2(v: Any) -> int:
    n = _int(1)(v)
    if n & (n - 1):
        raise _Bad(f"must be powers of two, got {v!r}")
    return n


def _one_of(options: tuple[Any, ...]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if v not in options or isinstance(v, bool) != isinstance(options[0], bool):
            raise _Bad(f"must hold values from {', '.join(map(str, options))}, got {v!r}")
        return v
    return check


_BOOLS = (True, False)
# key -> (TuneRequest field, check)
TOP: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model": ("model", _str),
    "engine": ("engine", _choice(engine_names())),
    "hardware": ("hardware", _str),
    "gpu": ("gpu", _gpu_sizes),
    "budget": ("gpu", _gpu_sizes),                  # gpu's older spelling (OLD_KEYS)
    "objective": ("objective", _wrap(_objective)),
    "ttft": ("ttft", _str),
    "ctx": ("ctx", _int(1)),
    "n_trials": ("trials", _int(1)),
    "study": ("study", _str),
    "storage": ("storage", _str),
    "dialect": ("dialect", _choice(DIALECTS)),
    "keep_free": ("keep_free", _wrap(_size)),
    "margin": ("margin", _wrap(_margin)),
    "seed": ("seed", _int(0)),
    "pool": ("pool", _int(0)),
    "confirm": ("confirm", _int(0)),
    "timeout_s": ("timeout_s", _float_pos),
    "llama_bench": ("llama_bench", _str),
    "cpu_stand_in": ("cpu_stand_in", _bool),
}
BENCH: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "n_prompt": ("n_prompt", _int(0)), "n_gen": ("n_gen", _int(0)), "depth": ("depth", _int(0)),
    "reps": ("reps", _int(1)),
}
# [space]: mode and kv_types are tune's flags; the rest limit tuner.space.SpaceConfig's choice lists
SPACE_LIMITS: dict[str, Callable[[Any], tuple[Any, ...]]] = {
    "ubatch": _choices(_pow2, sort=True), "min_batch": _choices(_pow2, sort=True),
    "batch_mult": _choices(_int(1), sort=True), "threads": _choices(_int(1)),
    "orders": _choices(_one_of(("first", "last", "spread"))), "output": _choices(_one_of(("gpu", "cpu"))),
    "partial": _choices(_one_of(_BOOLS)), "flash_attn": _choices(_one_of(_BOOLS)),
    "offload": _choices(_one_of(_BOOLS)), "mmap": _choices(_one_of(_BOOLS)),
    "only_active": _choices(_one_of(_BOOLS)), "fmoe": _choices(_one_of(_BOOLS)), "rtr": _choices(_one_of(_BOOLS)),
    "mla": _choices(_one_of((3, 2, 1))), "amb": _choices(_int(0)),
}
SPACE: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "mode": ("space", _choice(D.SPACE_MODES)), "kv_types": ("kv_types", _choices(_choice(KV_TYPES))),
}
TABLES = {"bench": BENCH, "space": SPACE}
OLD_KEYS = {"budget": "gpu"}      # a key's older spelling, read as the key (both at once: an error)
OLD_TABLES = {"workload": "bench"}    # a table's older name (a `workload` string is the user's requests)


def load_spec(path: str | Path) -> dict[str, Any]:
    """The TuneRequest fields a spec sets (plus `spec`, and `study` defaulting to the file's stem)."""
    p = Path(path)
    text = read_text(p, "--spec", SPEC_BYTES)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"--spec {p} is not TOML: {e}") from e
    out: dict[str, Any] = {"spec": str(p), "study": p.stem}
    limits: dict[str, tuple[Any, ...]] = {}
    for old, new in OLD_KEYS.items():
        if old in doc and new in doc:
            raise InputError(f"{p}: give {new} or its older spelling {old}, not both")
    for old, new in OLD_TABLES.items():
        if isinstance(doc.get(old), dict) and new in doc:
            raise InputError(f"{p}: give [{new}] or its older name [{old}], not both")
    for key, value in doc.items():
        if key == "workload" and isinstance(value, str):      # the user's requests (tune --workload)
            out["workload"] = _checked(p, key, _str, value)
            continue
        table = OLD_TABLES.get(key, key)          # messages name the table as the file spells it
        if table in TABLES:
            if not isinstance(value, dict):
                raise InputError(f"{p}: {key} must be a table ([{table}]), got {value!r}")
            for sub, v in value.items():
                if table == "space" and sub in SPACE_LIMITS:
                    limits[sub] = _checked(p, f"space.{sub}", SPACE_LIMITS[sub], v)
                elif sub in TABLES[table]:
                    name, check = TABLES[table][sub]
                    out[name] = _checked(p, f"{key}.{sub}", check, v)
                else:
                    known = [*TABLES[table], *(SPACE_LIMITS if table == "space" else ())]
                    raise InputError(f"{p}: unknown key {key}.{sub} (known in [{key}]: {', '.join(known)})")
        elif key in TOP:
            name, check = TOP[key]
            out[name] = _checked(p, key, check, value)
        else:
            raise InputError(f"{p}: unknown key {key!r} (known: {', '.join([*TOP, *TABLES])})")
    if limits:
        out["space_limits"] = limits
    out = _relative_to(p.parent, out)
    if "hardware" in out:
        from planner.hardware import load_hardware
        _checked(p, "hardware", _wrap(load_hardware), out["hardware"])
    return out


def check_model_file(spec: str | Path, model: str) -> None:
    """The spec's model, when it is the one used (a MODEL given on the command line overrides it), must exist."""
    if not model.startswith("preset:") and not Path(model).exists():
        raise InputError(f"{spec}: model {model} does not exist (a relative path is read from the spec's folder; "
                         "or give MODEL on the command line)")


def _checked(p: Path, key: str, check: Callable[[Any], Any], value: Any) -> Any:
    try:
        return check(value)
    except _Bad as e:
        raise InputError(f"{p}: {key} {e}") from None


def _relative_to(folder: Path, out: dict[str, Any]) -> dict[str, Any]:
    """Paths in a spec are read from the spec's folder (as a Makefile's are from its own), so a spec means the
    same study from any working directory: the model file, a JSON hardware profile, llama-bench, a SQLite file."""
    def rel(s: str) -> str:
        return s if Path(s).is_absolute() else str(folder / s)
    if "model" in out and not out["model"].startswith("preset:"):
        out["model"] = rel(out["model"])
    if "hardware" in out and out["hardware"].endswith(".json"):
        out["hardware"] = rel(out["hardware"])
    if "llama_bench" in out and "/" in out["llama_bench"]:
        out["llama_bench"] = rel(out["llama_bench"])
    url = out.get("storage", "")
    if url.startswith("sqlite:///") and url[len("sqlite:///"):] not in ("", ":memory:"):
        out["storage"] = "sqlite:///" + rel(url[len("sqlite:///"):])
    return out


def storage_beside(spec: str | Path, study: str) -> str:
    """The default storage of a spec'd study: STUDY.db in the spec's folder (studies/*.db is git-ignored)."""
    return f"sqlite:///{Path(spec).parent / (study + '.db')}"
