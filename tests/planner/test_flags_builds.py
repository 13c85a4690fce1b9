"""Flags per build (issue 40, items 5 and 9): a command for `--build DIALECT:N` uses only the flags that build has
(planner/builds.py FLAGS, one row per flag with its PR), or says in one line which flag it lacks and the oldest
build that has it; a flag the parser does not read says what to write instead (planner/flags/hints.py)."""
from __future__ import annotations

import json
import re

import pytest
from tiny import f32_inventory, qwen3moe_spec

from offload_tuner import cli
from planner.builds import FLAGS, PINNED, Build, Spelling
from planner.errors import FlagError
from planner.flags import SPECS, parse, render
from planner.flags.hints import BARE, REPLACEMENTS
from planner.flags.ik import _OLD_SERVER_FLAGS
from planner.flags.mainline import _OLD_FLAGS
from planner.plan import Knobs, OffloadPolicy, Plan

INV = f32_inventory(qwen3moe_spec(4))
NAMES = [t.name for t in INV.allocated()]


def plan(dialect: str, experts_on_cpu: tuple[int, ...] = (), knobs: Knobs = Knobs()) -> Plan:
    a = {n: "CPU" if n == "token_embd.weight" else "CUDA0" for n in NAMES}
    for t in INV.allocated():
        if t.is_expert and t.layer in experts_on_cpu:
            a[t.name] = "CPU"
    return Plan("tiny", a, knobs, dialect)  # type: ignore[arg-type]


def argv(p: Plan, number: int | None = None, tool: str = "server") -> list[str]:
    build = Build(p.dialect, number) if number is not None else None  # type: ignore[arg-type]
    return list(render(p, INV, tool, build=build))


# ---- the table ----------------------------------------------------------------------------------------------

def test_every_row_cites_its_change_and_every_build_dependent_flag_has_a_row():
    for (dialect, spelling), fact in FLAGS.items():
        assert re.search(r"PR \d+|[0-9a-f]{9}", fact.source), (dialect, spelling)
        assert fact.last_build is None or fact.first_build <= fact.last_build
    flags = [(d, f) for d, spec in SPECS.items() for t in spec.tools.values() for f in t.flags]
    flags += [("mainline", f) for fs in _OLD_FLAGS.values() for f in fs] + [("ik", f) for f in _OLD_SERVER_FLAGS]
    assert all((d, f.since) in FLAGS for d, f in flags if f.since is not None)
    # the pinned builds read every current flag; the old spellings are gone from them
    for d, spec in SPECS.items():
        assert all(PINNED[d].accepts(f.since) for t in spec.tools.values() for f in t.flags if f.since is not None)
    assert not PINNED["mainline"].accepts(Spelling.NO_MMAP) and not PINNED["mainline"].accepts(Spelling.FA_SWITCH)
    assert not PINNED["ik"].accepts(Spelling.FA_SWITCH) and PINNED["ik"].accepts(Spelling.NO_FA)


# ---- mainline -----------------------------------------------------------------------------------------------

def test_the_pinned_build_prints_what_it_printed():
    p = plan("mainline", (0, 1), Knobs(mmap=False))
    assert argv(p) == ["-ngl", "5", "-ncmoe", "2", "-fit", "off", "-c", "8192", "-np", "1", "-b", "2048", "-ub", "512",
                       "-fa", "on", "-lm", "none"]
    assert argv(p, 10200) == argv(p)          # a numbered build with every flag the pinned one has writes the same


def test_a_build_before_fit_gets_no_fit():
    p = plan("mainline", (0, 1))
    assert "-fit" in argv(p, 7407) and "-fit" not in argv(p, 7406)
    assert parse(argv(p, 7406), INV, "mainline", build=Build("mainline", 7406)).assignment == p.assignment
    with pytest.raises(FlagError, match=r"has no -fit on\|off .*from build 7407 on: PR 16653"):
        parse("-ngl 99 -fit off", INV, "mainline", build=Build("mainline", 7406))


def test_a_build_before_fa_values_gets_a_bare_fa_or_none():
    on, off = plan("mainline"), plan("mainline", knobs=Knobs(flash_attn=False))
    assert argv(on, 6325)[-2:] == ["-fa", "on"] and argv(off, 6325)[-2:] == ["-fa", "off"]
    old_on, old_off = argv(on, 6324), argv(off, 6324)
    assert old_on[-1] == "-fa" and "on" not in old_on                  # bare -fa turns it on
    assert "-fa" not in old_off                                          # off by default then
    back = parse(old_on, INV, "mainline", build=Build("mainline", 6324))
    assert back.knobs.flash_attn is True and parse(old_off, INV, "mainline", build=Build("mainline", 6324)
                                                   ).knobs.flash_attn is False
    # llama-bench took -fa 0|1 until PR 23714: the 1/0 we write reads the same everywhere
    assert argv(on, 6000, "bench")[-2:] == ["-fa", "1"]
    with pytest.raises(FlagError, match="unknown value 'on'"):
        parse("llama-bench -ngl 99 -fa on", INV, "mainline", build=Build("mainline", 9436))


def test_what_a_build_lacks_is_one_line_naming_the_oldest_build_that_has_it():
    p = plan("mainline", (2,))                  # one layer's experts in RAM: only an -ot says it
    assert "-ot" in argv(p, 5028)
    with pytest.raises(FlagError, match=r"mainline build 5027 has no -ot \(mainline has it from build 5028 on: PR "
                                        r"11397") as e:
        argv(p, 5027)
    assert "\n" not in str(e.value)
    # -cmoe/-ncmoe came later than -ot: a build between writes the overrides out
    every = plan("mainline", (0, 1, 2, 3))
    assert "-cmoe" in argv(every) and "-cmoe" not in argv(every, 6000) and "-ot" in argv(every, 6000)
    # an op-offload batch other than 32 needs GGML_OP_OFFLOAD_MIN_BATCH (PR 18535)
    mb = plan("mainline", knobs=Knobs(offload=OffloadPolicy.all(True, 64)))
    assert render(mb, INV, build=Build("mainline", 7671)).env == {"GGML_OP_OFFLOAD_MIN_BATCH": "64"}
    with pytest.raises(FlagError, match="GGML_OP_OFFLOAD_MIN_BATCH .*from build 7671 on: PR 18535"):
        argv(mb, 7670)


def test_ngl_counts_blocks_first_before_pr_18148():
    # before PR 18148 mainline's -ngl 4 was the 4 blocks, as ik's; after it the output layer and 3 blocks
    new = parse("-ngl 4", INV, "mainline").assignment
    old = parse("-ngl 4", INV, "mainline", build=Build("mainline", 7466)).assignment
    assert new["output.weight"] == "CUDA0" and new["blk.0.attn_q.weight"] == "CPU"
    assert old["output.weight"] == "CPU" and old["blk.0.attn_q.weight"] == "CUDA0"
    p = Plan("tiny", old, Knobs(), "mainline")
    assert argv(p, 7466)[:2] == ["-ngl", "4"] and argv(p)[:2] != ["-ngl", "4"]


def test_plan_build_option_renders_for_that_build(capsys):
    def lines(*build: str) -> dict[str, str]:
        assert cli.main(["plan", "preset:Qwen3-30B-A3B", "--gpu", "12GiB", "--json", *build]) == 0
        return json.loads(capsys.readouterr().out)["commands"]
    pinned, old = lines(), lines("--build", "mainline:6000")
    assert "-fit off" in pinned["llama-server"] and "-fa on" in pinned["llama-server"]
    for line in old.values():
        assert "-fit" not in line and "-fa on" not in line and "-lm" not in line and "-cmoe" not in line
    assert re.search(r" -fa( |$)", old["llama-server"])


# ---- ik -----------------------------------------------------------------------------------------------------

def test_ik_flash_attention_and_fused_moe_spellings_follow_the_build():
    on, off = plan("ik"), plan("ik", knobs=Knobs(flash_attn=False, fmoe=False))
    assert argv(on)[-2:] == ["-fa", "on"] and argv(off)[-5:] == ["-fa", "off", "-amb", "0", "-no-fmoe"]
    # PR 863 (3928) made both the default and dropped the switches; PR 944 (3985) brought -fa on|off back
    assert "-fa" not in argv(on, 3950) and "-no-fa" in argv(off, 3950) and "-no-fmoe" in argv(off, 3950)
    assert argv(on, 3900)[-3:] == ["-fa", "-fmoe", "-ooae"] and "-fa" not in argv(off, 3900) \
        and "-fmoe" not in argv(off, 3900)
    for n in (3900, 3950):
        for p in (on, off):
            back = parse(argv(p, n), INV, "ik", build=Build("ik", n)).knobs
            assert (back.flash_attn, back.fmoe) == (p.knobs.flash_attn, p.knobs.fmoe)


# ---- hints for flags a build does not read (item 9) ---------------------------------------------------------

def test_no_mmap_on_a_current_build_names_lm_none():
    with pytest.raises(FlagError, match=r"unknown flag '--no-mmap'.*write -lm none.*--build mainline:N") as e:
        parse("llama-server -ngl 99 --no-mmap", INV, "mainline")
    assert "\n" not in str(e.value)
    assert parse("-ngl 99 --no-mmap", INV, "mainline", build=Build("mainline", 9000)).knobs.mmap is False
    with pytest.raises(FlagError, match=r"'-mmp'.*write -lm none"):
        parse("llama-bench -ngl 99 -mmp 0", INV, "mainline")


@pytest.mark.parametrize("flag", ["-mla 3", "-amb 512", "-rtr", "-op 28,0", "-no-ooae", "-cuda fusion=1"])
def test_an_ik_flag_in_mainline_names_dialect_ik(flag):
    with pytest.raises(FlagError, match=rf"unknown flag '{flag.split()[0]}'.*say --dialect ik"):
        parse(f"-ngl 99 {flag}", INV, "mainline")


def test_ik_reading_a_mainline_flag_warns_with_what_ik_takes():
    w = [x for x in parse("-ngl 99 -lm none", INV, "ik").warnings if x.startswith("W024")]
    assert len(w) == 1 and "write --no-mmap" in w[0]
    w = [x for x in parse("-ngl 99 --no-op-offload", INV, "ik").warnings if x.startswith("W024")]
    assert len(w) == 1 and "-op -1,0" in w[0]
    with pytest.raises(FlagError, match="write -fa off"):
        parse("-ngl 99 -no-fa", INV, "mainline")


@pytest.mark.parametrize("dialect", ["mainline", "ik"])
def test_a_bare_fa_says_fa_on_instead_of_reporting_the_next_flag_as_its_value(dialect):
    for cmd in ("-fa -ngl 99", "-ngl 99 -fa"):
        with pytest.raises(FlagError, match=r"-fa (is followed by '-ngl'|ends the command line).*write -fa on") as e:
            parse(cmd, INV, dialect)
        assert "unknown value" not in str(e.value)
    assert parse("-fa -1 -ngl 99", INV, "mainline").knobs.flash_attn is True      # -1 is auto, a value
    # and the other way round: a value after an old build's bare switch
    old = 6000 if dialect == "mainline" else 3900
    with pytest.raises(FlagError, match=r"-fa on: in .* -fa is a bare switch"):
        parse("-ngl 99 -fa on", INV, dialect, build=Build(dialect, old))  # type: ignore[arg-type]


def test_every_hint_row_names_a_real_row():
    assert all(r.old is None or (d, r.old) in FLAGS for (d, _), r in REPLACEMENTS.items())
    assert all((d, b.old) in FLAGS and (d, b.new) in FLAGS for (d, _), b in BARE.items())
