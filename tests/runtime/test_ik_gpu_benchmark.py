"""benchmarks/ik_gpu.py --cpu: the ik GPU benchmark's whole pipeline (memory table, -op on/off, an ik study against
ik's --fit, the interleaved comparison with mainline's --fit) on the CPU ik and mainline builds, every plan all-CPU;
a second call resumes with nothing left to run; bad input is one line and exit 2."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.ik, pytest.mark.llamacpp]


@pytest.fixture
def bench(bench_script):
    return bench_script("ik_gpu")


@pytest.mark.slow
def test_ik_gpu_benchmark_dry_run(bench, ik_binaries, llama_bench, tmp_path):
    out = tmp_path / "out"
    argv = ["--cpu", "--workdir", str(tmp_path / "work"), "--out", str(out), "--name", "ik_gpu_cpu",
            "--plans", "all-gpu,exps-cpu-moe-op-off,up-gate-all,all-gpu-long-q8kv", "--rounds", "1", "--runs", "10",
            "--confirm", "2", "--pool", "20", "--mainline-bench", str(llama_bench)]
    assert bench.main(argv) == 0
    rep = json.loads((out / "ik_gpu_cpu.json").read_text())
    assert [p["name"] for p in rep["memory"]] == ["all-gpu", "exps-cpu-moe-op-off", "up-gate-all", "all-gpu-long-q8kv"]
    assert all(p["measurement"]["ok"] for p in rep["memory"])
    op_off = rep["memory"][1]
    assert "-op 28,0,31,0" in op_off["command"] and "CUDA0" not in op_off["ran"]      # the GPU line; ran all-CPU
    assert rep["memory"][3]["log"]["kv"] > 0 and rep["memory"][3]["predicted_parts"]["kv"] > 0
    assert len(rep["op"]) == 8 and all(o["pp"] for o in rep["op"])
    row = rep["study"][0]
    assert row["budget_gib"] == 1 and row["confirmed"] and row["runs"] <= 10 and row["fit"] is not None
    assert row["fit"]["flags"].startswith("llama-sweep-bench ")
    assert {(1, "ik-fit"), (1, "ml-fit")} <= {(r["budget_gib"], r["key"]) for r in rep["mainline"]}
    md = (out / "ik_gpu_cpu.md").read_text()
    assert "| up-gate-all |" in md and "| ub2048-both-off |" in md and "PP is not the same measure" in md
    assert "| 1 GiB | mainline --fit (llama-bench -fitt) |" in md and "| 1.000 |" in md     # TG x its own --fit
    assert bench.main(argv) == 0            # resumed: nothing left to run
