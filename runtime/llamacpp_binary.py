"""What a llama.cpp program is and accepts, asked of the program itself: where it is (`find_program`), its dialect,
flags, build and -ngl rule from --help and --version (`probe`, cached per path and mtime), and the devices it sees
(`list_devices`, `device_args`). Shared by the llama-bench engine (runtime/llamacpp.py) and the llama-server one
(runtime/llamaserver.py).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from collections.abc import Mapping, Sequence

from planner import children
from planner.builds import FEATURES, Build, Feature, from_version
from planner.errors import InputError
from planner.flags.common import SLOT_RULES, SlotRule
from planner.plan import Plan, gpu_index, is_gpu

Tool = Literal["bench", "sweep"]

# Spellings that only ik_llama.cpp's llama-bench / common parser list (docs/llamacpp.md section 8).
IK_MARKERS = frozenset({"-mla", "--mla-attn", "--mla-use", "-fmoe", "--fused-moe", "-rtr", "--run-time-repack",
                        "-amb", "--attn-max-batch", "--attention-max-batch"})
# What a binary can do, by the spellings that say so in its --help.
ABILITIES: dict[str, tuple[str, ...]] = {
    "override_tensor": ("-ot", "--override-tensor"),
    "n_cpu_moe": ("-ncmoe", "--n-cpu-moe"),
    "no_op_offload": ("-nopo", "--no-op-offload"),
    "depth": ("-d", "--n-depth"),
    "fit_target": ("-fitt", "--fit-target"),
    "gen_at_depth": ("-gp",),
    "load_mode": ("-lm", "--load-mode"),
}
# Mainline build that first has PR #18148 (planner/builds.py FEATURES); used when --help cannot tell.
NGL_OUTPUT_FIRST_BUILD = FEATURES[Feature.NGL_OUTPUT_FIRST].first_build
FLAG_TOKEN = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_OUTPUT_FORMATS = re.compile(r"--output <([a-z|]+)>")
_BUILD = re.compile(r"build[: ]+(\d+)|version: (\d+)")
_DEVICE_LINE = re.compile(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$", re.M)
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class BinaryInfo:
    """What a llama-bench / llama-sweep-bench binary is and accepts (from its --help and --version)."""
    path: Path
    tool: Tool
    dialect: str                      # "mainline" or "ik"
    flags: frozenset[str]             # every spelling its --help lists
    version: str                      # the --version line ("" when it has none)
    build_number: int | None          # None when unknown (0 in llama-cpp-python's vendored build)
    ngl_rule: SlotRule
    ngl_rule_source: str              # how we know: "dialect", "-fitt in --help", "build number", "assumed", "given"
    output_formats: tuple[str, ...]

    def accepts(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def build(self) -> Build:
        """The target build for rendering (planner/builds.py); an unknown number means the pinned build."""
        return Build(self.dialect, self.build_number, self.version)  # type: ignore[arg-type]

    @property
    def abilities(self) -> dict[str, bool]:
        return {name: any(s in self.flags for s in spellings) for name, spellings in ABILITIES.items()}

    @property
    def output_format(self) -> str:
        return "jsonl" if "jsonl" in self.output_formats else "json"

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "tool": self.tool, "dialect": self.dialect, "version": self.version,
                "build_number": self.build_number, "ngl_rule": self.ngl_rule, "ngl_rule_source": self.ngl_rule_source,
                "output_formats": list(self.output_formats), "abilities": self.abilities}


def find_program(program: str, flag: str, env_var: str, explicit: str | Path | None = None,
                 env: Mapping[str, str] | None = None, what: str | None = None) -> Path:
    """The `program` to run: `explicit` (given as `flag`), else $`env_var`, else `program` on PATH; an InputError
    naming where it looked when none is there (`what`: how the message names the program)."""
    env = os.environ if env is None else env
    for given, value in ((flag, explicit), (f"${env_var}", env.get(env_var))):
        if value:
            p = Path(value).expanduser()
            if not p.is_file():
                raise InputError(f"{given} {value}: no such file (give the path of {what or program})")
            if not os.access(p, os.X_OK):
                raise InputError(f"{given} {value}: not executable")
            return p
    found = shutil.which(program, path=env.get("PATH"))
    if found is None:
        raise InputError(f"no {program} found: pass {flag} PATH, set ${env_var}, or put {program} on PATH")
    return Path(found)


def find_binary(explicit: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The llama-bench to use: `explicit`, else $LLAMA_BENCH, else `llama-bench` on PATH (InputError if none)."""
    return find_program("llama-bench", "--llama-bench", "LLAMA_BENCH", explicit, env,
                        what="llama-bench or llama-sweep-bench")


def _capture(argv: Sequence[str]) -> tuple[int, str]:
    try:
        r = children.run(argv, capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S,
                         stdin=subprocess.DEVNULL)
    except OSError as e:
        raise InputError(f"cannot run {argv[0]}: {e.strerror or e}") from e
    except subprocess.TimeoutExpired as e:
        raise InputError(f"{argv[0]} {' '.join(argv[1:])} did not finish in {PROBE_TIMEOUT_S:g} s") from e
    return r.returncode, r.stdout + "\n" + r.stderr


def build_of_binary(path: str | Path) -> Build:
    """The build any llama.cpp / ik_llama.cpp program is (llama-server, llama-cli, llama-bench ...): the dialect
    from its --help (ik lists -mla/-fmoe/-rtr/-amb), the number from --version (llama-bench of ik has no
    --version: its number is then unknown and the pinned build is assumed)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"--build {path}: no such file (give DIALECT:NUMBER or the path of a llama.cpp program)")
    _, help_text = _capture([str(p), "--help"])
    dialect = "ik" if frozenset(FLAG_TOKEN.findall(help_text)) & IK_MARKERS else "mainline"
    rc, vtext = _capture([str(p), "--version"])
    return from_version(vtext if rc == 0 else "", dialect)  # type: ignore[arg-type]


def probe(path: str | Path, ngl_rule: SlotRule | None = None) -> BinaryInfo:
    """Probe a binary (cached per path, mtime and size): dialect, flags, version, -ngl rule."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    info = _probe(str(p), st.st_mtime_ns, st.st_size)
    if ngl_rule is not None and ngl_rule != info.ngl_rule:
        info = replace(info, ngl_rule=ngl_rule, ngl_rule_source="given")
    return info


@lru_cache(maxsize=32)
def _probe(path: str, mtime_ns: int, size: int) -> BinaryInfo:
    _, help_text = _capture([path, "--help"])
    flags = frozenset(FLAG_TOKEN.findall(help_text))
    name = Path(path).name
    if "sweep-bench" in help_text or "sweep-bench" in name:
        tool: Tool = "sweep"
    elif "--n-prompt" in flags:
        tool = "bench"
    else:
        raise InputError(f"{path} does not look like llama-bench or llama-sweep-bench (its --help lists no "
                         "--n-prompt); give the benchmark binary")
    dialect = "ik" if flags & IK_MARKERS else "mainline"
    version, build = "", None
    if "--version" in flags:
        _, vtext = _capture([path, "--version"])
        line = next((ln.strip() for ln in vtext.splitlines() if "version" in ln), "")
        version = line
        m = _BUILD.search(line)
        if m is not None:
            build = int(m.group(1) or m.group(2)) or None
    if dialect == "ik":
        rule, source = SLOT_RULES["ik"], "dialect"
    elif "-fitt" in flags:
        rule, source = "last_slots", "-fitt in --help (llama-bench gained it after PR #18148)"
    elif build is not None:
        rule = "last_slots" if build >= NGL_OUTPUT_FIRST_BUILD else "last_blocks"
        source = f"build number {build} (PR #18148 is build {NGL_OUTPUT_FIRST_BUILD})"
    else:
        rule, source = "last_slots", "assumed (no build number, no -fitt): output layer first"
    m = _OUTPUT_FORMATS.search(help_text)
    formats = tuple(m.group(1).split("|")) if m else (("jsonl",) if "--output-format" in flags else ())
    return BinaryInfo(Path(path), tool, dialect, flags, version, build, rule, source, formats)


def list_devices(path: str | Path, flags: frozenset[str]) -> dict[str, dict[str, Any]] | None:
    """`PROGRAM --list-devices` read into {"CUDA0": {"description", "total_bytes", "free_bytes"}} (mainline's
    llama-bench, llama-server ...); None when the program has no such flag (`flags`: its --help) or says nothing."""
    if "--list-devices" not in flags:
        return None
    rc, text = _capture([str(path), "--list-devices"])
    if rc != 0 or "Available devices" not in text:
        return None
    return {m.group(1): {"description": m.group(2), "total_bytes": int(m.group(3)) << 20,
                         "free_bytes": int(m.group(4)) << 20} for m in _DEVICE_LINE.finditer(text)}


def check_devices(plan: Plan, have: Mapping[str, Any] | None, program: str) -> None:
    """InputError when the plan names a GPU the program does not list (no check when it cannot list them)."""
    if have is None:
        return
    missing = [d for d in plan.devices() if d != "CPU" and d not in have]
    if missing:
        listed = ", ".join(have) or "none"
        raise InputError(f"the plan puts tensors on {missing[0]}, but {program} sees no such device "
                         f"(it lists: {listed}{'; a CPU-only build?' if not have else ''})")


def device_args(plan: Plan, have: Mapping[str, Any] | None, flags: frozenset[str]) -> list[str]:
    """`-dev CUDA0[/CUDA1..]` when the plan uses fewer GPUs than the program sees (`have`, from list_devices): without
    it llama.cpp splits the layers of a one-GPU plan's -ngl over every GPU by free memory (and takes a CUDA context
    on each), so the run would not be the plan. [] when the plan uses them all, none, or the program lists no
    devices or has no -dev."""
    used = [gpu_index(d) for d in plan.devices() if is_gpu(d)]
    if not have or not used:
        return []
    n = max(used) + 1
    if n >= sum(1 for d in have if is_gpu(d)) or not ({"-dev", "--device"} & flags):
        return []
    return ["-dev", "/".join(f"CUDA{i}" for i in range(n))]
