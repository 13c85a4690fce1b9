"""Engine builds: which llama.cpp / ik_llama.cpp build a command line is for, and what that build accepts.

A `Build` is a dialect and a build number: the number `--version` prints ("version: 4840 (8337e4cd)"), which is
the commit count of the project's history (cmake/build-info.cmake). Behaviour that changed between builds is a
row of FEATURES (first build that has it, and the PR), so rendering asks `build.has(Feature.X)` instead of
guessing. Without a binary the user names the target with `--build ik:4840` / `--build mainline:10114`; the
default is the pinned builds the tests run (PINNED).

Sources: ik build numbers are `git rev-list --count` of each PR's merge commit in ikawrakow/ik_llama.cpp (read
from its history at 8337e4cd); mainline's -lm from ggml-org/llama.cpp PR 20834, first seen in build 10114
(issue ggml-org/llama.cpp#26110 reports "version: 10114 (ed7adbfef)", 2026-07-24, with it); a build between the
merge and 10114 still accepts the deprecated --no-mmap, so treating it as older is safe.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from .errors import InputError
from .plan import DIALECTS, Dialect


class Feature(str, Enum):
    # mainline
    LOAD_MODE = "load_mode"                   # -lm none|mmap (server/cli and llama-bench); before: --no-mmap, -mmp 0
    # ik_llama.cpp
    TENSOR_OVERRIDES = "tensor_overrides"     # -ot
    OFFLOAD_POLICY = "offload_policy"         # -op OP,0|1 (server/cli/sweep-bench only)
    OP_IDS_689 = "op_ids_689"                 # ggml_op ids MUL_MAT 27, MUL_MAT_ID 28, MOE_FUSED_UP_GATE 30
    OP_IDS_741 = "op_ids_741"                 # + FUSED_UP_GATE 30, MOE_FUSED_UP_GATE 31
    ONLY_ACTIVE_EXPERTS = "ooae"              # upload only the activated experts (-ooae to enable)
    OOAE_DEFAULT_ON = "ooae_default_on"       # on by default, -no-ooae turns it off
    TS_BY_LAYER_BYTES = "ts_by_layer_bytes"   # -ts splits cumulative layer bytes; -ncmoe spread over GPUs
    NGL_AUTO = "ngl_auto"                     # no -ngl = 999 with a GPU; -ngl 0 drops every -ot and -ncmoe
    NCMOE_LAST_LAYERS = "ncmoe_last_layers"   # server -ncmoe N (one GPU) takes the LAST N MoE layers


@dataclass(frozen=True)
class FeatureFact:
    dialect: Dialect
    first_build: int
    source: str


FEATURES: dict[Feature, FeatureFact] = {
    Feature.LOAD_MODE: FeatureFact("mainline", 10114, "llama.cpp PR 20834 (first seen in build 10114)"),
    Feature.TENSOR_OVERRIDES: FeatureFact("ik", 3573, "ik PR 232 (85c6152e8)"),
    Feature.OFFLOAD_POLICY: FeatureFact("ik", 3683, "ik PR 405 (aa8ec5dfa)"),
    Feature.OP_IDS_689: FeatureFact("ik", 3838, "ik PR 689 (633e0617b) added an op before GGML_OP_MUL_MAT"),
    Feature.OP_IDS_741: FeatureFact("ik", 3869, "ik PR 741 (8de297b79) added GGML_OP_FUSED_UP_GATE"),
    Feature.ONLY_ACTIVE_EXPERTS: FeatureFact("ik", 3877, "ik PR 698 (13c3b6412)"),
    Feature.OOAE_DEFAULT_ON: FeatureFact("ik", 3917, "ik PR 842 (36f9601e8)"),
    Feature.TS_BY_LAYER_BYTES: FeatureFact("ik", 4327, "ik PR 1464/1466 (9b7db9bc3, 0871ab296)"),
    Feature.NGL_AUTO: FeatureFact("ik", 4761, "ik PR 2209 (b2d0b7c8c)"),
    Feature.NCMOE_LAST_LAYERS: FeatureFact("ik", 4797, "ik PR 2262 (da2293ded)"),
}


@dataclass(frozen=True)
class Build:
    """A target engine build. `number` None: unknown, treated as the pinned build of that dialect."""
    dialect: Dialect
    number: int | None
    label: str = ""

    def effective_number(self) -> int:
        return self.number if self.number is not None else PINNED_NUMBERS[self.dialect]

    def has(self, feature: Feature) -> bool:
        fact = FEATURES[feature]
        return fact.dialect == self.dialect and self.effective_number() >= fact.first_build

    def describe(self) -> str:
        n = "unknown build (assumed pinned)" if self.number is None else f"build {self.number}"
        return f"{self.dialect} {n}" + (f" ({self.label})" if self.label else "")


# The builds CI runs: ik_llama.cpp 8337e4cd (vendor/) and mainline as vendored by llama-cpp-python 0.3.36
# (commit 0c1e57098, which prints "version: 0 (unknown)"; it has -lm, so it is after PR 20834).
PINNED_NUMBERS: dict[str, int] = {"ik": 4840, "mainline": 10114}
PINNED: dict[str, Build] = {
    "ik": Build("ik", 4840, "ik_llama.cpp 8337e4cd, pinned"),
    "mainline": Build("mainline", None, "llama-cpp-python 0.3.36 vendor, pinned"),
}

_VERSION = re.compile(r"version:\s*(\d+)\s*\(([0-9a-fA-F]+|unknown)\)")
_SPEC = re.compile(r"(mainline|ik)(?::([0-9]+|pinned))?")      # fullmatch; ASCII digits, as the schema says


def from_version(text: str, dialect: Dialect) -> Build:
    """The build a `--version` output (or a log that starts with one) names; number 0 / none -> unknown."""
    m = _VERSION.search(text)
    if m is None or int(m.group(1)) == 0:
        return Build(dialect, None, "no build number in --version")
    return Build(dialect, int(m.group(1)), f"version {m.group(1)} ({m.group(2)})")


def parse_build(spec: str | None, dialect: Dialect) -> Build:
    """--build DIALECT[:NUMBER|:pinned] or None (the pinned build of `dialect`); InputError otherwise."""
    if spec is None or spec == "pinned":
        return PINNED[dialect]
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise InputError(f"--build {spec!r}: expected DIALECT[:NUMBER] with DIALECT one of {', '.join(DIALECTS)} "
                         "and NUMBER the build number `llama-server --version` prints (e.g. ik:4840, "
                         "mainline:10114), or 'pinned'")
    d = m.group(1)
    if d != dialect:
        raise InputError(f"--build {spec!r} is a {d} build but --dialect is {dialect}; say --dialect {d}")
    if m.group(2) in (None, "pinned"):
        return PINNED[d]
    return Build(d, int(m.group(2)), "given")  # type: ignore[arg-type]
