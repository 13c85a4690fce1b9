"""What to write instead of a flag a build does not read: the fixes `parse` (explain's parser) adds to its
unknown-flag errors and warnings, and to the error of a value flag given bare.

A flag is unknown to a build for one of three reasons, each answered from a table:
- another build of the dialect has it (planner/builds.py FLAGS): -fit on a build before --fit, --no-mmap on a
  build with -lm (REPLACEMENTS says what this build takes instead);
- the other dialect has it: -mla in mainline is ik's, -lm in ik is mainline's (read from the other dialect's
  tables; REPLACEMENTS where this dialect says it its own way, e.g. -no-fa is mainline's -fa off);
- BARE: a flag that now takes a value given as an old build's switch (-fa then the next flag): llama.cpp reads
  the next argument as its value and rejects it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..builds import Build, Spelling, flag_fact, since_text
from .cmdline import ToolTable


@dataclass(frozen=True)
class Replacement:
    fix: str                          # what to write in the dialect being read
    old: Spelling | None              # the FLAGS row of the spelling given, when some build of the dialect has it
    source: str


_LM = "PR 20834 folded --mmap/--no-mmap into --load-mode"
_NO_FA = "ik's spelling (ik PR 863); mainline takes -fa on|off|auto (PR 15434)"
_IK_LM = "mainline's --load-mode (PR 20834); ik keeps --no-mmap and maps the file by default"
_IK_FIT = "ik's fit is a switch, --fit (ik PR 1501), with --fit-margin N MiB per GPU"

# (dialect being read, spelling given) -> what to write instead
REPLACEMENTS: dict[tuple[str, str], Replacement] = {
    ("mainline", "--no-mmap"): Replacement("-lm none", Spelling.NO_MMAP, _LM),
    ("mainline", "--mmap"): Replacement("-lm mmap", Spelling.NO_MMAP, _LM),
    ("mainline", "-mmp"): Replacement("-lm none (or -lm mmap)", Spelling.BENCH_MMP, _LM),
    ("mainline", "-no-fa"): Replacement("-fa off", None, _NO_FA),
    ("mainline", "--no-flash-attn"): Replacement("-fa off", None, _NO_FA),
    ("ik", "-lm"): Replacement("--no-mmap for -lm none", None, _IK_LM),
    ("ik", "--load-mode"): Replacement("--no-mmap for --load-mode none", None, _IK_LM),
    ("ik", "--no-op-offload"): Replacement("-op -1,0", None, "ik's offload policy, -1 meaning every op (ik PR 405)"),
    ("ik", "-fit"): Replacement("--fit", None, _IK_FIT),
    ("ik", "-fitt"): Replacement("--fit-margin N", None, _IK_FIT),
    ("ik", "--fit-target"): Replacement("--fit-margin N", None, _IK_FIT),
}


@dataclass(frozen=True)
class Bare:
    fix: str                          # the value form
    old: Spelling                     # the FLAGS row of the bare switch
    new: Spelling                     # the FLAGS row of the value form


_FA_BARE: dict[str, Bare] = {
    "mainline": Bare("on", Spelling.FA_SWITCH, Spelling.FA_VALUE),
    "ik": Bare("on", Spelling.FA_SWITCH, Spelling.FA_VALUE),
}
# (dialect, spelling) -> the bare form's facts
BARE: dict[tuple[str, str], Bare] = {(d, s): b for d, b in _FA_BARE.items() for s in ("-fa", "--flash-attn")}


@dataclass(frozen=True)
class Hints:
    """flags/cmdline.FlagHints for one dialect, tool and build: `full` is the dialect's table of the pinned build
    (every current flag, each with its `since`), `other` the other dialect's table of the same tool."""
    dialect: str
    build: Build
    full: ToolTable
    other: ToolTable

    def unknown(self, name: str) -> str:
        flag = self.full.lookup.get(name)
        if flag is not None and flag.since is not None and not self.build.accepts(flag.since):
            return self.build.lacks(flag.since)
        rep = REPLACEMENTS.get((self.dialect, name))
        if rep is not None:
            text = f"write {rep.fix} ({rep.source})"
            fact = flag_fact(self.dialect, rep.old) if rep.old is not None else None
            if rep.old is not None and fact is not None and not self.build.accepts(rep.old):
                text += (f", or, for a command of an older build, say --build {self.dialect}:N with its number "
                         f"({name} is {since_text(self.dialect, rep.old)})")
            return text
        if name in self.other.lookup or name in self.other.known:
            return (f"{name} is {'an ik_llama.cpp' if self.other.dialect == 'ik' else 'a mainline llama.cpp'} flag: "
                    f"for that program say --dialect {self.other.dialect}")
        return ""

    def bad_value(self, name: str, value: str | None) -> str:
        """A value flag given bare (`value` the next flag, or None at the end), or a value after a switch."""
        bare = BARE.get((self.dialect, name))
        if bare is None:
            return ""
        if self.build.accepts(bare.old) and value is not None and not value.startswith("-"):
            return (f"{name} {value}: in {_who(self.build)} {name} is a bare switch that turns it on and takes no "
                    f"value ({name} on|off|auto is {since_text(self.dialect, bare.new)}); write {name} alone, or "
                    f"nothing for off")
        if not self.build.accepts(bare.new) or (value is not None and not value.startswith("-")):
            return ""
        got = "ends the command line" if value is None else f"is followed by {value!r}"
        return (f"{name} {got}: {_who(self.build)} takes {name} on|off|auto ({since_text(self.dialect, bare.new)})"
                f" and would read the next argument as its value; write {name} {bare.fix} (a bare {name} is the "
                f"switch of {self.dialect} builds {_range(self.dialect, bare.old)}: for a command of such a build say "
                f"--build {self.dialect}:N with its number)")


def _who(build: Build) -> str:
    return f"the pinned {build.dialect} build" if build.number is None else f"{build.dialect} build {build.number}"


def _range(dialect: str, spelling: Spelling) -> str:
    fact = flag_fact(dialect, spelling)
    if fact is None:
        return "before"
    return f"{fact.first_build}-{fact.last_build}" if fact.last_build is not None else f"{fact.first_build} on"
