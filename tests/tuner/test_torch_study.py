"""benchmarks/torch_study.py end to end with the sim engine (the cost model as the engine): the -ngl grid, the
study, the comparison; a second call resumes both without redoing anything; the time budget; one clear line
when the torch engine cannot run here."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from planner.hardware import GiB
from planner.memory import estimate

@pytest.fixture(scope="module")
def bench():
    from bench_scripts import load_benchmark
    yield load_benchmark("torch_study")
    sys.modules.pop("torch_study", None)


def _sim(out: Path, *extra: str) -> list[str]:
    return ["--engine", "sim", "--out", str(out), "--pool", "20", *extra]


def _runs(db_url: str, name: str, bench) -> int:
    from tuner.storage import load_study
    return bench.engine_runs(load_study(name, db_url))


def test_grid_is_every_other_ngl_up_to_the_most_that_fits(bench, tmp_path):
    s = bench.Setup(bench.build_parser().parse_args(_sim(tmp_path)))
    pts = bench.grid_plans(s)
    inv = s.inv
    for ub in bench.GRID_UBATCHES:
        ns = [n for n, u, _ in pts if u == ub]
        top = ns[-1]
        # more than 14 values of N fit (a BF16 layer is ~1.27 GB, ~18 of them in 23.5 GiB): every other N from 0,
        # and the most that fits
        assert ns[0] == 0 and ns[:-1] == list(range(0, top, 2)) and top - ns[-2] in (1, 2)
        plan = next(p for n, u, p in pts if u == ub and n == top)
        assert plan.knobs.n_ubatch == ub and plan.knobs.n_batch == 2048 and plan.knobs.offload.any_enabled
        assert not s.room.fits(estimate(inv, bench.parse_ngl(inv, top + 1, plan.knobs), s.hw))
        assert s.room.fits(estimate(inv, plan, s.hw)) and 16 <= top <= 20
    # -ngl 2 (llama.cpp: i_gpu_start = n_layer + 1 - N): the last layer and the output layer on the GPU, all else
    # (blk.0-46, token_embd) in RAM
    two = next(p for n, u, p in pts if n == 2 and u == 512)
    on_gpu = sorted(name for name, dev in two.assignment.items() if dev == "CUDA0")
    assert on_gpu == sorted([t.name for t in inv.tensors if t.layer == 47] + ["output.weight", "output_norm.weight"])


@pytest.mark.slow
def test_dry_run_then_a_resume_that_redoes_nothing(bench, tmp_path):
    out = tmp_path / "out"
    assert bench.main(_sim(out, "--trials", "3")) == 0
    grid = json.loads((out / "torch_grid.json").read_text())
    res = json.loads((out / "torch_study.json").read_text())
    name = res["settings"]["study"]
    url = f"sqlite:///{out / 'torch_study.db'}"
    assert _runs(url, name, bench) == 3
    assert len(grid["points"]) == len(res["grid"]) >= 2 * 9
    assert all(p["measured"]["ok"] and p["within_budget"] for p in grid["points"])
    assert res["study"]["engine_runs"]["trials"] == 3 and res["study"]["front"]
    for side in ("tg", "pp"):
        b = res["best"][side]
        assert b["grid"] and b["study"] and b["ratio"] > 0
    assert all(p["peak_bytes"] <= 24 * GiB - 512 * 2**20 for p in res["study"]["trials"] if p["ok"])
    md = (out / "torch_study.md").read_text()
    assert "| N | ubatch | PP t/s | TG t/s | peak GiB | predicted GiB | within budget |" in md
    assert "## Study: measured Pareto front" in md and "study / grid" in md
    assert (out / "torch_study.png").stat().st_size > 0
    assert (out / "reports" / name / "pareto.png").exists() and (out / "reports" / name / "summary.md").exists()

    # the same study, 2 more runs: the grid is read back (not measured again), the study goes on from 3 runs
    assert bench.main(_sim(out, "--trials", "5")) == 0
    assert json.loads((out / "torch_grid.json").read_text()) == grid
    assert _runs(url, name, bench) == 5
    res2 = json.loads((out / "torch_study.json").read_text())
    assert res2["study"]["engine_runs"]["trials"] == 5
    # other settings than the saved grid's: one line, exit 2
    assert bench.main(_sim(out, "--trials", "5", "--n-gen", "64", "--phase", "grid")) == 2


def test_time_budget_starts_nothing_once_spent(bench, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench.main(_sim(out, "--time-budget", "0", "--phase", "grid")) == 0
    assert json.loads((out / "torch_grid.json").read_text() if (out / "torch_grid.json").exists()
                      else '{"points": []}')["points"] == []
    assert "time budget reached" in capsys.readouterr().err


def test_torch_engine_without_cuda_is_one_line(bench, tmp_path, capsys):
    from runtime.gpumem import cuda_available
    if cuda_available():
        pytest.skip("a CUDA GPU is here: the torch engine would run")
    assert bench.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("torch_study: error: engine torch ") and "CUDA" in err[0]
    assert not (tmp_path / "out").exists()
