"""Engine builds: which llama.cpp / ik_llama.cpp build a command line is for, and what that build accepts.

A `Build` is a dialect and a build number: the number `--version` prints ("version: 4840 (8337e4cd)"), which is
the commit count of the project's history (cmake/build-info.cmake). Behaviour that changed between builds is a
row of FEATURES (first build that has it, and the PR), and each flag whose existence depends on the build a row
of FLAGS (first build, last build where it was removed, and the PR), so rendering asks `build.has(Feature.X)` /
`build.accepts(Spelling.Y)` instead of guessing. Without a binary the user names the target with `--build
ik:4840` / `--build mainline:10114`; the default is the pinned builds the tests run (PINNED).

Sources: every build number is `git rev-list --count` of the PR's merge commit (the build that commit prints):
ik's from ikawrakow/ik_llama.cpp's history at 8337e4cd (the pinned tree, build 4840), mainline's from
ggml-org/llama.cpp's master history read at 3f545becc (build 10587, 2026-08-23; commit ed7adbfef counts 10114
there, as issue ggml-org/llama.cpp#26110 reports "version: 10114 (ed7adbfef)"). Both forks share the history
before ik split off, so the old mainline rows (bare -fa, -mmp) have the same number in both. Hashes are the
merge commits in the fork named.
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
    NGL_OUTPUT_FIRST = "ngl_output_first"     # -ngl N takes the last N slots, the output layer first (slot rule)
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
    Feature.LOAD_MODE: FeatureFact("mainline", 10105, "llama.cpp PR 20834 (e6dd0e29a)"),
    Feature.NGL_OUTPUT_FIRST: FeatureFact("mainline", 7467, "llama.cpp PR 18148 (57c1e0564); before it -ngl took the "
                                          "last N blocks and the output layer only past n_layer, as ik does"),
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


class Spelling(str, Enum):
    """A flag (or environment variable) we write or read whose existence depends on the build, as written.
    llama-server, llama-cli and llama-sweep-bench share one parser; llama-bench's rows are the BENCH_ ones."""
    FA_SWITCH = "-fa"                       # bare: flash attention on (off by default)
    FA_VALUE = "-fa on|off|auto"
    NO_FA = "-no-fa"                        # ik
    OVERRIDE_TENSOR = "-ot"
    CPU_MOE = "-cmoe"
    N_CPU_MOE = "-ncmoe"
    NO_OP_OFFLOAD = "--no-op-offload"
    MIN_BATCH_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"
    LOAD_MODE = "-lm"
    NO_MMAP = "--no-mmap"
    NO_HOST = "--no-host"
    SWA_FULL = "--swa-full"
    FIT = "-fit on|off"
    FIT_TARGET = "-fitt"
    CACHE_RAM = "--cache-ram"
    KV_UNIFIED = "-kvu"
    NEGATED = "--op-offload, -kvo"          # mainline: the positive forms of --no-op-offload, -nkvo
    OFFLOAD_POLICY = "-op"                  # ik
    OOAE = "-ooae"                          # ik
    NO_OOAE = "-no-ooae"                    # ik
    RTR = "-rtr"                            # ik
    MLA = "-mla"                            # ik
    AMB = "-amb"                            # ik
    FMOE = "-fmoe"                          # ik
    NO_FMOE = "-no-fmoe"                    # ik
    CUDA_PARAMS = "-cuda"                   # ik
    IK_FIT = "--fit"                        # ik: a switch
    BENCH_FA_VALUE = "llama-bench -fa on|off|auto"
    BENCH_FA_01 = "llama-bench -fa 0|1"     # mainline's only values before BENCH_FA_VALUE
    BENCH_FMOE = "llama-bench -fmoe 0|1"    # ik
    BENCH_OVERRIDE_TENSOR = "llama-bench -ot"
    BENCH_N_CPU_MOE = "llama-bench --n-cpu-moe"
    BENCH_MMP = "llama-bench -mmp 0|1"
    BENCH_FIT_TARGET = "llama-bench -fitt"


@dataclass(frozen=True)
class FlagFact:
    first_build: int
    source: str
    last_build: int | None = None        # the last build that accepts it; None: still there


_NO_MMAP_LAST = 10587    # deprecated from PR 20834 on, still in master at 3f545becc (10587), gone from the pinned tree

FLAGS: dict[tuple[Dialect, Spelling], FlagFact] = {
    ("mainline", Spelling.FA_SWITCH): FlagFact(2771, "PR 5021 (9c67c2773) added bare -fa; PR 15434 gave it a value",
                                               6324),
    ("mainline", Spelling.FA_VALUE): FlagFact(6325, "PR 15434 (e81b8e4b7), default auto; 1/0/-1 aliases from PR "
                                                    "15746 (c466abe15, build 6358)"),
    ("mainline", Spelling.OVERRIDE_TENSOR): FlagFact(5028, "PR 11397 (e0e912f49)"),
    ("mainline", Spelling.CPU_MOE): FlagFact(6089, "PR 15077 (ec428b02c) added the short -cmoe; --cpu-moe came with "
                                                   "PR 14992 (a06ed5fea, build 6051)"),
    ("mainline", Spelling.N_CPU_MOE): FlagFact(6089, "PR 15077 (ec428b02c)"),
    ("mainline", Spelling.NO_OP_OFFLOAD): FlagFact(5346, "PR 13386 (7f323a589), llama-bench -nopo too"),
    ("mainline", Spelling.MIN_BATCH_ENV): FlagFact(7671, "PR 18535 (9a5724dee); before it the batch was 32"),
    ("mainline", Spelling.LOAD_MODE): FlagFact(10105, "PR 20834 (e6dd0e29a), llama-bench too"),
    ("mainline", Spelling.NO_MMAP): FlagFact(308, "84cfa98c4; deprecated by PR 20834 (build 10105), still in master at "
                                                  "3f545becc (build 10587), gone from the pinned tree", _NO_MMAP_LAST),
    ("mainline", Spelling.NO_HOST): FlagFact(6700, "PR 16310 (3df2244df), llama-bench too"),
    ("mainline", Spelling.SWA_FULL): FlagFact(5429, "PR 13194 (e298d2fbd)"),
    ("mainline", Spelling.FIT): FlagFact(7407, "PR 16653 (b1f3a6e5d), on by default"),
    ("mainline", Spelling.FIT_TARGET): FlagFact(7407, "PR 16653 (b1f3a6e5d); one value per device from PR 18679 "
                                                      "(64848deb1, build 7672)"),
    ("mainline", Spelling.CACHE_RAM): FlagFact(6723, "PR 16391 (d00cbea63)"),
    ("mainline", Spelling.KV_UNIFIED): FlagFact(5913, "PR 14363 (225e7a143)"),
    ("mainline", Spelling.NEGATED): FlagFact(7376, "PR 17919 (380b4c984)"),
    ("mainline", Spelling.BENCH_FA_VALUE): FlagFact(9437, "PR 23714 (aa46bda89); before it llama-bench -fa took 0|1 "
                                                          "only (PR 5021, build 2771)"),
    ("mainline", Spelling.BENCH_FA_01): FlagFact(2771, "PR 5021 (9c67c2773); PR 23714 took on|off|auto", 9436),
    ("mainline", Spelling.BENCH_OVERRIDE_TENSOR): FlagFact(5200, "PR 12922 (c0a97b762)"),
    ("mainline", Spelling.BENCH_N_CPU_MOE): FlagFact(6490, "PR 15952 (8ff206097)"),
    ("mainline", Spelling.BENCH_MMP): FlagFact(2042, "PR 5257 (128dcbd3c); deprecated by PR 20834 (build 10105), gone "
                                                     "from the pinned tree", _NO_MMAP_LAST),
    ("mainline", Spelling.BENCH_FIT_TARGET): FlagFact(8679, "PR 21304 (94ca829b6)"),
    ("ik", Spelling.FA_SWITCH): FlagFact(2771, "PR 5021 (3a4c3c374, before the fork); PR 863 turned FA on by default "
                                               "and dropped it", 3927),
    ("ik", Spelling.NO_FA): FlagFact(3928, "ik PR 863 (41d6c42b9), FA on by default"),
    ("ik", Spelling.FA_VALUE): FlagFact(3985, "ik PR 944 (874926800; --flash-attn spelled right from 22c20fcd6, "
                                              "build 3988), auto = on"),
    ("ik", Spelling.OVERRIDE_TENSOR): FlagFact(3573, "ik PR 232 (85c6152e8), llama-bench too"),
    ("ik", Spelling.BENCH_OVERRIDE_TENSOR): FlagFact(3573, "ik PR 232 (85c6152e8)"),
    ("ik", Spelling.CPU_MOE): FlagFact(3833, "ik PR 672 (6bda22a4d)"),
    ("ik", Spelling.N_CPU_MOE): FlagFact(3833, "ik PR 672 (6bda22a4d)"),
    ("ik", Spelling.BENCH_N_CPU_MOE): FlagFact(3980, "ik PR 937 (25cd985c9)"),
    ("ik", Spelling.OFFLOAD_POLICY): FlagFact(3683, "ik PR 405 (aa8ec5dfa), server/cli/sweep-bench only"),
    ("ik", Spelling.OOAE): FlagFact(3877, "ik PR 698 (13c3b6412); PR 842 made it the default", 3916),
    ("ik", Spelling.NO_OOAE): FlagFact(3917, "ik PR 842 (36f9601e8), llama-bench too"),
    ("ik", Spelling.RTR): FlagFact(3512, "ik PR 147 (a648191c2), llama-bench too"),
    ("ik", Spelling.MLA): FlagFact(3551, "ik PR 188 (3e536b95b), llama-bench too"),
    ("ik", Spelling.AMB): FlagFact(3576, "ik PR 237 (e787c0014), llama-bench too"),
    ("ik", Spelling.FMOE): FlagFact(3571, "ik PR 229 (b50efcc9d); PR 863 made fused MoE the default (llama-bench "
                                          "keeps -fmoe 0|1)", 3927),
    ("ik", Spelling.BENCH_FMOE): FlagFact(3571, "ik PR 229 (b50efcc9d)"),
    ("ik", Spelling.NO_FMOE): FlagFact(3928, "ik PR 863 (41d6c42b9)"),
    ("ik", Spelling.CUDA_PARAMS): FlagFact(3961, "ik PR 910 (532a05e46), llama-bench too"),
    ("ik", Spelling.NO_MMAP): FlagFact(308, "84cfa98c4, before the fork"),
    ("ik", Spelling.BENCH_MMP): FlagFact(2042, "PR 5257 (4e4146995, before the fork)"),
    ("ik", Spelling.CACHE_RAM): FlagFact(3995, "ik PR 954 (bb358223c)"),
    ("ik", Spelling.IK_FIT): FlagFact(4349, "ik PR 1501 (86f4f516e); llama-bench --fit 0|1 from ik PR 1542"),
}


def flag_fact(dialect: str, spelling: Spelling) -> FlagFact | None:
    return FLAGS.get((dialect, spelling))  # type: ignore[arg-type]


def since_text(dialect: str, spelling: Spelling) -> str:
    """'from build 7407 on: PR 16653 ...': the builds that have a flag, for messages; '' if the dialect never had it."""
    fact = flag_fact(dialect, spelling)
    if fact is None:
        return ""
    if fact.last_build is not None:
        return f"in builds {fact.first_build}-{fact.last_build}: {fact.source}"
    return f"from build {fact.first_build} on: {fact.source}"


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

    def accepts(self, spelling: Spelling) -> bool:
        """Whether this build's parser has the flag (FLAGS)."""
        fact = flag_fact(self.dialect, spelling)
        n = self.effective_number()
        return fact is not None and fact.first_build <= n and (fact.last_build is None or n <= fact.last_build)

    def lacks(self, spelling: Spelling) -> str:
        """One phrase for a flag this build does not have: which builds do, or that the dialect never had it."""
        where = since_text(self.dialect, spelling)
        flag = spelling.value
        if not where:
            return f"{self.dialect} has no {flag}"
        return f"{self.describe()} has no {flag} ({self.dialect} has it {where})"

    def describe(self) -> str:
        n = "unknown build (assumed pinned)" if self.number is None else f"build {self.number}"
        return f"{self.dialect} {n}" + (f" ({self.label})" if self.label else "")


# The builds CI runs: ik_llama.cpp 8337e4cd (vendor/) and mainline as vendored by llama-cpp-python 0.3.36
# (commit 0c1e57098, which prints "version: 0 (unknown)"). Its number is a lower bound: it has -lm and no longer
# accepts the --no-mmap that master still had at build 10587, so it is at least 10588.
PINNED_NUMBERS: dict[str, int] = {"ik": 4840, "mainline": _NO_MMAP_LAST + 1}
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
