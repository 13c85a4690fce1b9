"""The README's examples are the program's output: each fenced block that starts with `$ offload-tuner ...` holds
commands and what they print. `check` runs every command (in-process, in a scratch folder) and compares; `write`
puts the output in place (`make readme`). Kept out of the comparison: wall-clock durations ("in 24.1 s"), and in a
measuring command's output (MASKS: `run`) only what the machine decides: the plan id, the speeds and their spread,
the peak RSS; its program is named as llama.cpp names it (`llama-bench`, not this machine's path to it) and is
the pinned CPU build (runtime/llamacpp_build.py) unless $LLAMA_BENCH or PATH has one.

A block may shorten an output with a line `...`: the lines between the `...` lines are runs that must appear in
the output in that order, each as long as the README has it (the first run from the output's first line when
the block does not start with `...`; a later one from the line with its first line's label, the text before
the first ':'). A block without `...` is the whole output.
A command may end in `| head -N`. A plan for --gpu alone has this machine's RAM: the examples are run with
README_RAM, the generic desktop's, on every machine. Usage: python tests/readme_examples.py [--write] [README]"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "$ offload-tuner "
ELLIPSIS = "..."
_DURATION = re.compile(r"\bin \d+(\.\d+)? s\b")
# what a measuring command prints that another machine prints otherwise, masked where the line compares, by
# the command's first word: run's plan id (it hashes knobs the build's defaults fill in), speeds, spread and RSS
MASKS: dict[str, tuple[tuple[re.Pattern[str], str], ...]] = {
    "run": ((re.compile(r"\bplan [0-9a-f]{12}\b"), "plan ID"),
            (re.compile(r"\b\d+(\.\d+)? t/s \(\d+(\.\d+)?-\d+(\.\d+)? over"), "N t/s (N-N over"),
            (re.compile(r"\b\d+(\.\d+)? t/s"), "N t/s"),
            (re.compile(r"\bRSS \d+(\.\d+)? [KMG]iB\b"), "RSS N MiB")),
}
_PROGRAM = re.compile(r"^command: \S*/(llama-[a-z-]+) ")       # the program as llama.cpp names it, not its path
README_RAM = "128GiB"              # OFFLOAD_TUNER_RAM for the examples (offload_tuner/app/common.py machine_ram_bytes)


@dataclass
class Example:
    command: str                   # after "offload-tuner "
    lines: list[str]               # the output as the README has it
    start: int                     # README line index of the first output line
    end: int                       # one past the last


def examples(text: str) -> list[Example]:
    """Every `$ offload-tuner` command inside a fenced block, with the output lines below it."""
    out: list[Example] = []
    lines = text.split("\n")
    i, in_block = 0, False
    while i < len(lines):
        if lines[i].startswith("```"):
            in_block = not in_block
            i += 1
            continue
        if in_block and lines[i].startswith(PROMPT):
            cmd = lines[i][len(PROMPT):]
            while cmd.endswith("\\"):           # a shell continuation line
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            start = i = i + 1
            while i < len(lines) and not lines[i].startswith("```") and not lines[i].startswith("$ "):
                i += 1
            out.append(Example(cmd.strip(), lines[start:i], start, i))
            continue
        i += 1
    return out


def _llama_bench(argv: list[str]) -> dict[str, str]:
    """The environment a command that runs llama-bench needs: none where $LLAMA_BENCH or PATH names one, else the
    pinned CPU build (built once per machine)."""
    if "llamacpp" not in argv or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench"):
        return {}
    from runtime.llamacpp_build import ensure_built
    return {"LLAMA_BENCH": str(ensure_built()["llama-bench"])}


def run(command: str, cwd: Path) -> list[str]:
    """The command's stdout and stderr lines, as a terminal shows them (the CLI in this process)."""
    from offload_tuner import cli
    head = None
    if (m := re.search(r"\s*\|\s*head -(\d+)\s*$", command)) is not None:
        head, command = int(m.group(1)), command[:m.start()]
    argv = shlex.split(command)
    buf = io.StringIO()
    old = Path.cwd()
    bench = _llama_bench(argv)
    os.chdir(cwd)
    os.environ["OFFLOAD_TUNER_RAM"] = README_RAM
    os.environ.update(bench)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            cli.main(argv)
    finally:
        os.chdir(old)
        for k in bench:          # set for this command only: it was unset
            del os.environ[k]
    got = [_PROGRAM.sub(r"command: \1 ", x) for x in buf.getvalue().rstrip("\n").split("\n")]
    return got[:head] if head is not None else got


def _norm(line: str, command: str = "") -> str:
    line = _DURATION.sub("in N s", line.rstrip())
    for pattern, mask in MASKS.get(command.split(" ", 1)[0], ()):
        line = pattern.sub(mask, line)
    return line


def runs(expected: list[str]) -> list[list[str]]:
    """The runs of lines between `...` lines ([] first when the block starts with `...`)."""
    out: list[list[str]] = [[]]
    for line in expected:
        if line.strip() == ELLIPSIS:
            out.append([])
        else:
            out[-1].append(line)
    return out


def matched(expected: list[str], got: list[str]) -> list[str] | None:
    """The README lines `expected` would become for output `got`, keeping its `...` cuts; None when a run of it
    cannot be placed in the output (its first line is nowhere there)."""
    parts = runs(expected)
    g = [_norm(x) for x in got]
    new: list[str] = []
    at = 0
    for k, part in enumerate(parts):
        if k > 0:
            new.append(ELLIPSIS)
        if not part and len(parts) > 1:      # an empty run between cuts; a block with no output gets it all
            continue
        if k == 0:
            pos = 0
        else:        # a later run starts at its first line's label (text before the first ':' or the line)
            label = _norm(part[0]).split(":")[0]
            pos = next((j for j in range(at, len(g)) if g[j].split(":")[0] == label), None)
            if pos is None:
                return None
        new += got if len(parts) == 1 else got[pos:pos + len(part)]     # no cut: the whole output
        at = pos + len(part)
    return new


def check(readme: Path = ROOT / "README.md", write: bool = False) -> list[str]:
    """Differences between the README's examples and the program's output (fixed in place with `write`). The
    commands run in the README's order (a later one may read what an earlier one wrote); the rewrites are applied
    last first, so none moves a block still to come."""
    text = readme.read_text()
    lines = text.split("\n")
    problems: list[str] = []
    rewrites: list[tuple[Example, list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="readme-") as tmp:
        for ex in examples(text):
            got = run(ex.command, Path(tmp))
            new = matched(ex.lines, got)
            if new is None:
                problems.append(f"offload-tuner {ex.command}: a shortened run of the README's output is not in "
                                "the program's output")
                continue
            c = ex.command
            if [_norm(x, c) for x in new] != [_norm(x, c) for x in ex.lines]:
                first = next(i for i, (a, b) in enumerate(zip([*ex.lines, ""], [*new, ""]))
                             if _norm(a, c) != _norm(b, c))
                want = ex.lines[first] if first < len(ex.lines) else "(nothing)"
                have = new[first] if first < len(new) else "(nothing)"
                problems.append(f"offload-tuner {ex.command}: line {first + 1}: README {want!r}, program {have!r}")
                rewrites.append((ex, new))
    if write and rewrites:
        for ex, new in reversed(rewrites):
            lines[ex.start:ex.end] = new
        readme.write_text("\n".join(lines))
    return problems


if __name__ == "__main__":
    write = "--write" in sys.argv[1:]
    paths = [a for a in sys.argv[1:] if a != "--write"]
    sys.path.insert(0, str(ROOT))
    found = check(Path(paths[0]) if paths else ROOT / "README.md", write=write)
    for p in found:
        print(p)
    print(f"README examples: {'rewritten' if write and found else 'up to date' if not found else 'stale'}")
    sys.exit(1 if found and not write else 0)
