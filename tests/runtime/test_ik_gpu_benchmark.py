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
            "--plans", "all-gpu,exps-cpu-moe-op-off,up-gate-all,all-gpu-long-q8kv,ds-mla3,ds-mla2-nofa-ub2048-amb256",
            "--rounds", "1", "--runs", "10",
            "--confirm", "2", "--pool", "20", "--mainline-bench", str(llama_bench)]
    assert bench.main(argv) == 0
    rep = json.loads((out / "ik_gpu_cpu.json").read_text())
    assert [p["name"] for p in rep["memory"]] == ["all-gpu", "exps-cpu-moe-op-off", "up-gate-all", "all-gpu-long-q8kv"]
    assert all(p["measurement"]["ok"] for p in rep["memory"])
    op_off = rep["memory"][1]
    assert "-op 28,0,31,0" in op_off["command"] and "CUDA0" not in op_off["ran"]      # the GPU line; ran all-CPU
    assert rep["memory"][3]["log"]["kv"] > 0 and rep["memory"][3]["predicted_parts"]["kv"] > 0
    # the mla step: DeepSeek's MLA graphs on a tiny DeepSeek, ik's logged compute buffer as the model predicts it
    assert [p["name"] for p in rep["mla"]] == ["ds-mla3", "ds-mla2-nofa-ub2048-amb256"]
    for p in rep["mla"]:
        assert p["measurement"]["ok"] and "-mla" in p["command"]
        logged = p["log"]["compute"] + p["log"]["output"]
        assert abs(logged - p["predicted_parts"]["compute"]) < (1 << 20), p["name"]
    assert "-amb 256" in rep["mla"][1]["command"] and "-fa off" in rep["mla"][1]["command"]
    # --repredict reads each MLA plan back from its GPU command (-mla, -fa, -amb, -c) to the prediction it had
    from planner.gguf_header import load_inventory
    from planner.hardware import load_hardware
    for p in rep["mla"]:
        p["cuda0"]["measured_bytes"] = p["cuda0"]["predicted_bytes"]       # a stand-in: a CPU run measures none
    again_rows = bench.repredict(rep, load_inventory(rep["meta"]["mla_model"]), load_hardware("gpu-box"), "mla")
    assert [r["cuda0"]["predicted_bytes"] for r in again_rows] == [p["cuda0"]["predicted_bytes"] for p in rep["mla"]]
    assert len(rep["op"]) == 8 and all(o["pp"] for o in rep["op"])
    row = rep["study"][0]
    assert row["budget_gib"] == 1 and row["confirmed"] and row["runs"] <= 10 and row["fit"] is not None
    assert row["fit"]["flags"].startswith("llama-sweep-bench ")
    assert {(1, "ik-fit"), (1, "ml-fit")} <= {(r["budget_gib"], r["key"]) for r in rep["mainline"]}
    md = (out / "ik_gpu_cpu.md").read_text()
    assert "| up-gate-all |" in md and "| ub2048-both-off |" in md and "PP is not the same measure" in md
    assert "## DeepSeek's MLA graphs" in md and "| ds-mla2-nofa-ub2048-amb256 |" in md
    assert "| 1 GiB | mainline --fit (llama-bench -fitt) |" in md and "| 1.000 |" in md     # TG x its own --fit
    assert bench.main(argv) == 0            # resumed: nothing left to run
    # the state --out gets after every result is all a fresh workdir needs: nothing runs again there either
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    import tarfile
    with tarfile.open(out / "ik_gpu_state.tgz") as tar:
        assert {"results", "ik_gpu.db"} <= {m.name.split("/")[0] for m in tar.getmembers()}
        tar.extractall(fresh, filter="data")
    again = [a if a != str(tmp_path / "work") else str(fresh) for a in argv]
    again += ["--model", str(tmp_path / "work" / "tiny-qwen3moe-q4_0.gguf"),
              "--mla-model", str(tmp_path / "work" / "tiny-deepseek2-q4_0.gguf"), "--out", str(tmp_path / "out2")]
    n_results = len(list((fresh / "results").iterdir()))
    assert bench.main(again) == 0
    assert len(list((fresh / "results").iterdir())) == n_results
    assert json.loads((tmp_path / "out2" / "ik_gpu_cpu.json").read_text())["study"][0]["confirmed"]


def test_the_mainline_study_is_the_newest_confirmed_one_unless_a_series_is_named(bench, tmp_path):
    """ik_gpu's mainline step compares with the tune_vs_fit study of the same budget: the newest confirmed one of
    any series by default (series come and go as the study changes), the one of --mainline-series when given."""
    import optuna
    db = tmp_path / "tvf.db"
    url = f"sqlite:///{db}"
    for name, created, confirmed in (("tvf-8g-d0", "2026-11-20 10:00:00", True),
                                     ("tvf-8g-d0-nh2", "2026-11-24 09:00:00", True),
                                     ("tvf-8g-d0-new", "2026-11-24 12:00:00", False),
                                     ("tvf-8g-d8192-nh3", "2026-11-25 12:00:00", True),
                                     ("tvf-16g-d0-nh", "2026-11-22 12:00:00", True)):
        st = optuna.create_study(study_name=name, storage=url)
        st.set_user_attr("created", created)
        if confirmed:
            st.set_user_attr("confirmed", {"rounds": 3})

    def ctx(series):
        args = bench.parse_args(["--cpu", "--mainline-db", str(db), "--budgets", "8,16,4"]
                                + (["--mainline-series", series] if series is not None else []))
        return bench.Ctx(args, None, None, None, tmp_path, 0.0, lambda: None)
    picked = {b: getattr(bench.mainline_study(ctx(None), b), "study_name", None) for b in (8, 16, 4)}
    assert picked == {8: "tvf-8g-d0-nh2", 16: "tvf-16g-d0-nh", 4: None}
    assert bench.mainline_study(ctx(""), 8).study_name == "tvf-8g-d0"
    assert bench.mainline_study(ctx("nh2"), 16) is None
