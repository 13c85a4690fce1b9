"""Bad command lines over every subcommand: each is one line `offload-tuner: error: ...` naming the offending
value, exit 2, no traceback, no hang, and nothing written. (Command lines that must work are at the end.)"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from cli_outcome import run_cli

M = "preset:Qwen3-30B-A3B"
HW_OK = {"name": "box", "gpus": [{"name": "g", "vram_bytes": 25769803776, "mem_bw": 1e12, "flops": 1e14}],
         "host": {"ram_bytes": 137438953472, "mem_bw": 7.5e10, "flops": 7e11, "n_threads": 8},
         "link": {"h2d_pinned": 2.5e10, "h2d_pageable": 1e10}}


def explain_ngl99(*flags: str, gpu: str | None = None) -> list[str]:
    """`explain M [--gpu GPU] -- -ngl 99 FLAGS`: a command line that is fine but for the flags after -ngl 99."""
    return ["explain", M, *(["--gpu", gpu] if gpu else []), "--", "-ngl", "99", *flags]


def _hw(tmp: Path, name: str, edit) -> str:
    d = json.loads(json.dumps(HW_OK))
    edit(d)
    p = tmp / f"{name}.json"
    p.write_text(json.dumps(d))
    return str(p)


def _set(path: list, value):
    def edit(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return edit


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("badcli")
    from runtime.synth import tiny_spec, uniform_recipe, write_gguf
    tiny = write_gguf(tmp / "tiny.gguf", tiny_spec("qwen3moe"), uniform_recipe("Q8_0"))[0]
    (tmp / "binary.json").write_bytes(bytes(range(256)) * 4)
    (tmp / "afile").write_text("x")
    (tmp / "dir.gguf").mkdir()
    (tmp / "readonly").mkdir()
    os.chmod(tmp / "readonly", stat.S_IRUSR | stat.S_IXUSR)
    plan_ok = json.loads(json.dumps({"model_id": "m", "dialect": "mainline",
                                     "assignment": {}, "knobs": {}}))
    (tmp / "plan_list.json").write_text(json.dumps({**plan_ok, "assignment": ["a"]}))
    (tmp / "plan_knob.json").write_text(json.dumps({**plan_ok, "knobs": {"n_batch": "big"}}))
    from planner.loader import load_model
    inv = load_model(str(tiny))
    names = {t.name: "CPU" for t in inv.allocated()}
    (tmp / "plan_gpu9.json").write_text(json.dumps({**plan_ok, "assignment": {**names, "output.weight": "GPU9"}}))
    (tmp / "plan_cuda3.json").write_text(json.dumps({**plan_ok, "assignment": {**names, "output.weight": "CUDA3"}}))
    (tmp / "plan_typed.json").write_text(json.dumps({**plan_ok, "assignment": names, "knobs": {"n_ctx": 1.5}}))
    (tmp / "plan_text.json").write_text("not json")
    # a workload log line nested 100,000 deep (json.loads: RecursionError)
    (tmp / "deep.jsonl").write_text('{"usage": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    fake = tmp / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'usage: llama-bench'\n")
    fake.chmod(0o755)
    return {"tmp": str(tmp), "tiny": str(tiny), "fake": str(fake),
            "hw_types": _hw(tmp, "types", _set(["gpus", 0, "vram_bytes"], "24GiB")),
            "hw_zero_bw": _hw(tmp, "zero", _set(["host", "mem_bw"], 0)),
            "hw_nogpu": _hw(tmp, "nogpu", _set(["gpus"], [])),
            "hw_cpuonly": _hw(tmp, "cpuonly", lambda d: (d.__setitem__("gpus", []),
                                                       d.__setitem__("link", {"h2d_pinned": 0.0,
                                                                              "h2d_pageable": 0.0}))),
            "hw_nan": _hw(tmp, "nan", _set(["gpus", 0, "flops"], float("inf"))),
            "hw_extra": _hw(tmp, "extra", _set(["host", "cores"], 8)),
            "hw_list": _hw(tmp, "list", lambda d: d.__setitem__("gpus", {"a": 1})),
            }


BAD: list = [                 # (name, argv) or a pytest.param of them
    # top level
    ("no command", []),
    ("unknown command", ["frobnicate"]),
    # inspect
    ("inspect missing file", ["inspect", "{tmp}/nope.gguf"]),
    ("inspect folder", ["inspect", "{tmp}/dir.gguf"]),
    ("inspect binary", ["inspect", "{tmp}/binary.json"]),
    ("inspect unknown preset", ["inspect", "preset:Nope"]),
    ("inspect bad quant", ["inspect", "preset:Qwen3-30B-A3B:Q9_9"]),
    ("inspect unknown flag", ["inspect", M, "--frob"]),
    # plan: sizes and hardware
    ("plan huge gpu", ["plan", M, "--gpu", "9" * 30]),
    ("plan fraction gpu", ["plan", M, "--gpu", "0.5"]),
    ("plan zero gpu", ["plan", M, "--gpu", "0"]),
    ("plan negative gpu", ["plan", M, "--gpu", "-24GiB"]),
    ("plan empty gpu", ["plan", M, "--gpu", ","]),
    ("plan unknown workload", ["plan", M, "--gpu", "12GiB", "--workload", "nope"]),
    ("plan 17 gpus", ["plan", M, "--gpu", ",".join(["8GiB"] * 17)]),
    ("plan unit", ["plan", M, "--gpu", "24Gibibytes"]),
    ("plan no hardware", ["plan", M]),
    ("plan margin unit", ["plan", M, "--gpu", "24GiB", "--margin", "lots"]),
    ("plan margin huge", ["plan", M, "--gpu", "24GiB", "--margin", "99TiB"]),
    ("plan top -1", ["plan", M, "--gpu", "24GiB", "--top", "-1"]),
    ("plan ctx 0", ["plan", M, "--gpu", "24GiB", "--ctx", "0"]),
    ("plan ubatch -1", ["plan", M, "--gpu", "24GiB", "--ubatch", "-1"]),
    ("plan threads 0", ["plan", M, "--gpu", "24GiB", "--threads", "0"]),
    ("plan kv type", ["plan", M, "--gpu", "24GiB", "--kv-type", "q3"]),
    ("plan dialect", ["plan", M, "--gpu", "24GiB", "--dialect", "vllm"]),
    ("plan objective", ["plan", M, "--gpu", "24GiB", "--objective", "fast"]),
    ("plan hardware preset", ["plan", M, "--hardware", "rtx9090"]),
    ("plan hardware types", ["plan", M, "--hardware", "{hw_types}"]),
    ("plan hardware zero bw", ["plan", M, "--hardware", "{hw_zero_bw}"]),
    ("plan hardware inf", ["plan", M, "--hardware", "{hw_nan}"]),
    ("plan hardware extra field", ["plan", M, "--hardware", "{hw_extra}"]),
    ("plan hardware gpus not a list", ["plan", M, "--hardware", "{hw_list}"]),
    ("plan hardware no gpus", ["plan", M, "--hardware", "{hw_nogpu}"]),
    ("plan hardware cpu-only calibrate", ["plan", M, "--hardware", "{hw_cpuonly}"]),
    ("plan hardware binary", ["plan", M, "--hardware", "{tmp}/binary.json"]),
    ("plan hardware missing json", ["plan", M, "--hardware", "{tmp}/missing.json"]),
    ("plan nothing fits", ["plan", M, "--gpu", "1MiB"]),
    # explain: llama.cpp's own limits
    ("explain no args", ["explain", M]),
    ("explain regex hang", explain_ngl99("-ot", "(.|.)*Z=CPU")),
    ("explain regex nested", explain_ngl99("-ot", "(.*)*Z=CPU")),
    ("explain ncffn huge", explain_ngl99("-ncffn", "99999999999")),
    ("explain ncmoe huge", explain_ngl99("-ncmoe", "99999999999")),
    ("explain ncmoe negative", explain_ngl99("-ncmoe", "-3")),
    ("explain ub0 b0", explain_ngl99("-b", "0", "-ub", "0")),
    ("explain b0", explain_ngl99("-b", "0")),
    ("explain c negative", explain_ngl99("-c", "-5")),
    ("explain c huge", explain_ngl99("-c", "99999999999")),
    ("explain ts negative", explain_ngl99("-ts", "1,-1")),
    ("explain ts nan", explain_ngl99("-ts", "nan,1")),
    ("explain ts more gpus", explain_ngl99("-ts", "3,1", gpu="24GiB")),
    ("explain ot CUDA7", explain_ngl99("-ot", "exps=CUDA7", gpu="24GiB")),
    ("explain dev CUDA3", explain_ngl99("-dev", "CUDA3", gpu="24GiB")),
    ("explain comma regex", explain_ngl99("-ot", "blk\\.(1|2|3),ffn.*=CPU")),
    ("explain bad buft", explain_ngl99("-ot", "exps=CUDA_Host")),
    ("explain unknown flag", explain_ngl99("--frobnicate")),
    ("explain bad int", ["explain", M, "--", "-ngl", "lots"]),
    ("explain np 0", explain_ngl99("-np", "0")),
    ("explain kv type", explain_ngl99("-ctk", "q3")),
    ("explain missing value", ["explain", M, "--", "-ngl"]),
    ("explain bench negative ub", ["explain", M, "--", "llama-bench", "-ngl", "99", "-ub", "-1"]),
    # run
    ("run neither plan nor args", ["run", M, "--engine", "sim"]),
    ("run bad reps", ["run", M, "--engine", "sim", "--reps", "0", "--", "-ngl", "0"]),
    ("run plan missing", ["run", "{tiny}", "--engine", "sim", "--plan", "{tmp}/nope.json"]),
    ("run plan not json", ["run", "{tiny}", "--engine", "sim", "--plan", "{tmp}/plan_text.json"]),
    ("run plan list assignment", ["run", "{tiny}", "--engine", "sim", "--plan", "{tmp}/plan_list.json"]),
    ("run plan knob type", ["run", "{tiny}", "--engine", "sim", "--plan", "{tmp}/plan_knob.json"]),
    ("run plan device GPU9", ["run", "{tiny}", "--engine", "sim", "--plan", "{tmp}/plan_gpu9.json"]),
    ("run plan device CUDA3", ["run", "{tiny}", "--engine", "sim", "--gpu", "24GiB", "--plan",
                               "{tmp}/plan_cuda3.json"]),
    ("run plan float ctx", ["run", "{tiny}", "--engine", "sim", "--plan", "{tmp}/plan_typed.json"]),
    ("run ot CUDA3", ["run", "{tiny}", "--engine", "sim", "--gpu", "24GiB", "--", "-ngl", "99", "-ot",
                      "exps=CUDA3"]),
    ("run not a bench", ["run", "{tiny}", "--engine", "llamacpp", "--llama-bench", "{fake}", "--", "-ngl", "0"]),
    ("run missing bench", ["run", "{tiny}", "--engine", "llamacpp", "--llama-bench", "{tmp}/nope", "--", "-ngl",
                           "0"]),
    # synth
    ("synth out folder", ["synth", "--arch", "qwen3moe", "--tiny", "--out", "{tmp}"]),
    ("synth out under file", ["synth", "--arch", "qwen3moe", "--tiny", "--out", "{tmp}/afile/x.gguf"]),
    ("synth unknown arch", ["synth", "--arch", "mamba", "--tiny", "--out", "{tmp}/x.gguf"]),
    ("synth bad split", ["synth", "--arch", "qwen3moe", "--tiny", "--out", "{tmp}/x.gguf", "--split-max", "0"]),
    ("synth no out", ["synth", "--arch", "qwen3moe", "--tiny"]),
    # calibrate (checked before any measuring)
    ("calibrate threads -1", ["calibrate", "--threads", "-1"]),
    ("calibrate size", ["calibrate", "--size", "9TiB"]),
    ("calibrate out folder", ["calibrate", "--out", "{tmp}"]),
    ("calibrate out missing folder", ["calibrate", "--out", "{tmp}/no/such/hw.json"]),
    # tune (checked before the study runs)
    ("tune gpu 1MiB", ["tune", M, "--gpu", "1MiB", "--trials", "2", "--storage", "sqlite:///{tmp}/t.db"]),
    ("tune margin 99TiB", ["tune", M, "--gpu", "16GiB", "--margin", "99TiB", "--trials", "2", "--storage",
                           "sqlite:///{tmp}/t.db"]),
    ("tune out /dev/null/x", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--out", "/dev/null/x", "--storage",
                              "sqlite:///{tmp}/t.db"]),
    ("tune out read-only", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--out", "{tmp}/readonly/r",
                            "--storage", "sqlite:///{tmp}/t.db"]),
    ("tune storage no folder", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--storage",
                                "sqlite:///{tmp}/no-such-folder/dir/x.db"]),
    ("tune storage under file", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--storage",
                                 "sqlite:///{tmp}/afile/x.db"]),
    ("tune storage not url", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--storage", "studies/x.db"]),
    ("tune storage unknown scheme", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--storage", "nosuchdb://x"]),
    ("tune trials 0", ["tune", M, "--gpu", "16GiB", "--trials", "0"]),
    ("tune pool -1", ["tune", M, "--gpu", "16GiB", "--pool", "-1"]),
    ("tune objective", ["tune", M, "--gpu", "16GiB", "--objective", "tg +* pp"]),
    ("tune kv types", ["tune", M, "--gpu", "16GiB", "--kv-types", "f16,q3"]),
    ("tune workload zero", ["tune", M, "--gpu", "16GiB", "--n-prompt", "0", "--n-gen", "0"]),
    ("tune depth -1", ["tune", M, "--gpu", "16GiB", "--depth", "-1"]),
    ("tune ctx small", ["tune", M, "--gpu", "16GiB", "--ctx", "16", "--storage", "sqlite:///{tmp}/t2.db"]),
    ("tune engine torch here", ["tune", M, "--gpu", "16GiB", "--engine", "torch"]),
    ("tune hardware cpu-only", ["tune", M, "--hardware", "{hw_cpuonly}", "--trials", "2"]),
    # numbers out of range, checked by the request itself (the CLI, a JSON body and a study spec alike; issue 43)
    ("tune seed -1", ["tune", M, "--gpu", "16GiB", "--seed", "-1"]),
    ("tune seed 2**32", ["tune", M, "--gpu", "16GiB", "--seed", str(2**32)]),
    ("tune pool 10**12", ["tune", M, "--gpu", "16GiB", "--pool", str(10**12)]),
    ("tune trials 10**12", ["tune", M, "--gpu", "16GiB", "--trials", str(10**12)]),
    ("tune timeout nan", ["tune", M, "--gpu", "16GiB", "--timeout", "nan"]),
    ("tune timeout inf", ["tune", M, "--gpu", "16GiB", "--timeout", "inf"]),
    ("tune timeout 0", ["tune", M, "--gpu", "16GiB", "--timeout", "0"]),
    ("tune timeout -5", ["tune", M, "--gpu", "16GiB", "--timeout", "-5"]),
    ("tune timeout 1e400", ["tune", M, "--gpu", "16GiB", "--timeout", "1e400"]),
    ("tune reps 10**9", ["tune", M, "--gpu", "16GiB", "--reps", str(10**9)]),
    ("tune n-prompt 10**20", ["tune", M, "--gpu", "16GiB", "--n-prompt", str(10**20)]),
    ("tune n-gen 10**20", ["tune", M, "--gpu", "16GiB", "--n-gen", str(10**20)]),
    ("tune depth 10**20", ["tune", M, "--gpu", "16GiB", "--depth", str(10**20)]),
    ("tune ctx 10**20", ["tune", M, "--gpu", "16GiB", "--ctx", str(10**20)]),
    ("tune confirm 10**9", ["tune", M, "--gpu", "16GiB", "--confirm", str(10**9)]),
    ("tune ttft 400 digits", ["tune", M, "--gpu", "16GiB", "--objective", "time", "--ttft", "9" * 400]),
    ("tune storage sqlite://", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--storage", "sqlite://"]),
    ("tune storage :memory:", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--storage", "sqlite:///:memory:"]),
    ("tune storage mode=memory", ["tune", M, "--gpu", "16GiB", "--trials", "2", "--storage",
                                  "sqlite:///file:x?mode=memory&uri=true"]),
    ("report storage sqlite://", ["report", "nope", "--storage", "sqlite://"]),
    ("plan ubatch over batch", ["plan", M, "--gpu", "24GiB", "--ubatch", "4096", "--batch", "512"]),
    ("plan ctx 10**20", ["plan", M, "--gpu", "24GiB", "--ctx", str(10**20)]),
    ("plan ubatch 10**20", ["plan", M, "--gpu", "24GiB", "--ubatch", str(10**20)]),
    ("plan batch 0", ["plan", M, "--gpu", "24GiB", "--batch", "0"]),
    ("plan threads 10**20", ["plan", M, "--gpu", "24GiB", "--threads", str(10**20)]),
    ("plan amb -1", ["plan", M, "--gpu", "24GiB", "--dialect", "ik", "--amb", "-1"]),
    ("plan amb 10**20", ["plan", M, "--gpu", "24GiB", "--dialect", "ik", "--amb", str(10**20)]),
    ("plan top 10**20", ["plan", M, "--gpu", "24GiB", "--top", str(10**20)]),
    ("plan workload nested 100000 deep", ["plan", M, "--gpu", "24GiB", "--workload", "{tmp}/deep.jsonl"]),
    ("run timeout nan", ["run", M, "--engine", "sim", "--timeout", "nan", "--", "-ngl", "0"]),
    ("run timeout inf", ["run", M, "--engine", "sim", "--timeout", "inf", "--", "-ngl", "0"]),
    ("run timeout 0", ["run", M, "--engine", "sim", "--timeout", "0", "--", "-ngl", "0"]),
    ("run n-prompt 10**20", ["run", M, "--engine", "sim", "--n-prompt", str(10**20), "--", "-ngl", "0"]),
    ("run depth 10**20", ["run", M, "--engine", "sim", "--depth", str(10**20), "--", "-ngl", "0"]),
    ("run reps 10**9", ["run", M, "--engine", "sim", "--reps", str(10**9), "--", "-ngl", "0"]),
    ("serve max-trials 10**12", ["serve", "--port", "0", "--max-trials", str(10**12)]),
    ("serve max-tunes 0", ["serve", "--port", "0", "--max-tunes", "0"]),
    ("serve request-limit 0", ["serve", "--port", "0", "--request-limit", "0"]),
    ("serve port 70000", ["serve", "--port", "70000"]),
    ("demo pool 10**12", ["demo", "--pool", str(10**12)]),
    ("demo trials 10**12", ["demo", "--trials", str(10**12)]),
    ("synth seed -1", ["synth", "--arch", "qwen3moe", "--tiny", "--out", "{tmp}/s.gguf", "--seed", "-1"]),
    ("synth seed 2**32", ["synth", "--arch", "qwen3moe", "--tiny", "--out", "{tmp}/s.gguf", "--seed", str(2**32)]),
    # report
    ("report missing study", ["report", "nope", "--storage", "sqlite:///{tmp}/none.db"]),
    ("report out /dev/null/x", ["report", "nope", "--out", "/dev/null/x"]),
    ("report storage bad", ["report", "nope", "--storage", "nosuchdb://x"]),
    # demo
    ("demo trials word", ["demo", "--trials", "many"]),
]


@pytest.mark.parametrize("name, argv", BAD, ids=[getattr(b, "values", b)[0] for b in BAD])
def test_bad_command_line_is_one_clean_line(name, argv, env, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)                     # anything written lands here, and is checked below
    if os.geteuid() == 0 and "read-only" in name:
        pytest.skip("root writes into read-only folders")
    o = run_cli([a.format(**env) for a in argv], time_limit_s=60)
    assert o.kind == "error", (o.kind, o.rc, o.stderr[-800:])
    assert not any(tmp_path.iterdir()), f"{name} wrote {list(tmp_path.iterdir())}"


def test_demo_when_studies_is_a_file(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "studies").write_text("x")
    o = run_cli(["demo", "--trials", "2", "--quiet"])
    assert o.kind == "error" and "studies" in o.stderr


GOOD: list[tuple[str, list[str], str]] = [
    ("margin 0", ["plan", M, "--gpu", "24GiB", "--margin", "0", "--json"], ""),
    ("cpu-only profile plus --gpu", ["plan", M, "--hardware", "{hw_cpuonly}", "--gpu", "24GiB"], "generic GPU"),
    ("ub 0 is -b", ["explain", M, "--json", "--", "-ngl", "99", "-c", "8192", "-ub", "0"], "W028"),
    ("c 0 is the training context", ["explain", M, "--json", "--", "-ngl", "99", "-c", "0"], ""),
    ("ncmoe beyond the layers", ["explain", M, "--json", "--", "-ngl", "99", "-ncmoe", "2147483647"], ""),
]


@pytest.mark.parametrize("name, argv, needle", GOOD, ids=[g[0] for g in GOOD])
def test_edge_values_that_work(name, argv, needle, env, capsys):
    import contextlib
    import io
    from offload_tuner import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main([a.format(**env) for a in argv])
    assert rc == 0, capsys.readouterr().err
    assert needle in out.getvalue()
