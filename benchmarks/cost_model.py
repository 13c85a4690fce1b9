"""Cost model vs measured llama.cpp runs (issue 16): the sim engine's prediction of every run in a runs JSONL, from
a hardware profile alone, against what llama-bench measured.

Writes cost_model_<name>.json and cost_model_<name>.md to --out (default benchmarks/reported): per run the
predicted and measured PP and TG and their errors, the mean absolute percentage error (MAPE) over all runs and
over the two halves the engine constants were fitted on / held out from (even / odd lines of the shared H100
file; for a fresh file every run is unseen by the fit), the worst cases, and the op offload on vs off ranking:
measured pairs that differ only in op offload (and the load mode), and each run against its own plan with op
offload switched (predicted only).

    python3 benchmarks/cost_model.py --runs tests/planner/data/h100_llamacpp_runs.jsonl --hardware gpu-box --name h100
    python3 benchmarks/cost_model.py --runs fresh.jsonl --hardware hw.json --out DIR --name h100_fresh
    python3 benchmarks/cost_model.py --runs fresh.jsonl --hardware old_hw.json --restamp   # profile from before a refit

--model is the model the runs used: a .gguf (only its header is read) or preset:NAME[:QUANT]; the default is
benchmarks/llamacpp_gpu.py's synthetic Qwen3-30B-A3B-shaped Q4_0 file, rebuilt from its recipe (no file needed).
--fit refits the engine constants (planner.hardware.LLAMACPP_SHARES, planner.cost.EngineFacts) on the even
lines and prints them (needs scipy): how the committed constants were obtained.
Needs only numpy from outside the repository (no gguf package, no torch).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cost import LLAMACPP, EngineFacts, predict  # noqa: E402
from planner.hardware import HardwareProfile, load_hardware  # noqa: E402
from planner.model import ModelInventory  # noqa: E402
from runtime.cost_check import (Run, Scored, mape, offload_pairs, read_runs, restamped, score,  # noqa: E402
                                split_train_test, synthetic_inventory, toggled_offload)

WORST = 8
# the fitted constants: Overheads shares and EngineFacts fields, with their bounds
FIT_SHARES = {"gpu_eff": (0.05, 1.5), "cpu_eff": (0.05, 1.5), "gpu_gemm_eff": (0.005, 1.0),
              "cpu_gemm_eff": (0.005, 1.0)}
FIT_FACTS = {"cpu_thread_exp": (0.3, 2.0), "synthetic_expert_pool": (8.0, 128.0), "tg_gpu_op_scale": (0.5, 5.0)}
# attention at depth: identifiable only from runs at depth (--fit-depth RUNS), fitted with the others held
FIT_DEPTH = {"tg_kv_eff": (0.05, 2.0), "tg_kv_quant_cost": (1.0, 5.0), "pp_attn_scale": (0.05, 2.0)}


def fit_depth(runs: list[Run], inv: ModelInventory, hw: HardwareProfile) -> tuple[dict[str, float], EngineFacts]:
    """Least squares on log(predicted / measured) of TG and PP over `runs` (depth runs and depth-0 runs, so the
    PP attention term stays right at depth 0 too), in FIT_DEPTH only."""
    import numpy as np
    from scipy.optimize import least_squares
    names = list(FIT_DEPTH)

    def facts(x) -> EngineFacts:
        return replace(LLAMACPP, **dict(zip(names, (float(a) for a in x))))

    def resid(x):
        sc = score(runs, inv, hw, facts(x))
        return np.array([math.log(s.pred_tg_tps / s.run.tg_tps) for s in sc if s.run.tg_tps > 0]
                        + [math.log(s.pred_pp_tps / s.run.pp_tps) for s in sc if s.run.pp_tps > 0])
    res = least_squares(resid, [1.0, 1.0, 1.0], bounds=([b[0] for b in FIT_DEPTH.values()],
                                                        [b[1] for b in FIT_DEPTH.values()]))
    return dict(zip(names, (round(float(a), 4) for a in res.x))), facts(res.x)


def load_model(text: str | None) -> ModelInventory:
    if not text:
        return synthetic_inventory()
    from planner.loader import load_model as load
    return load(text)


def _row(s: Scored) -> dict[str, Any]:
    k = s.run.plan.knobs
    return {"index": s.run.index, "command": s.run.command, "ubatch": k.n_ubatch_eff, "threads": k.n_threads,
            "op_offload": k.offload.any_enabled, "mmap": k.mmap, "flash_attn": k.flash_attn,
            "measured_tg_tps": s.run.tg_tps, "predicted_tg_tps": round(s.pred_tg_tps, 3), "err_tg": round(s.err_tg, 4),
            "measured_pp_tps": s.run.pp_tps, "predicted_pp_tps": round(s.pred_pp_tps, 2), "err_pp": round(s.err_pp, 4),
            "breakdown_s": {key: round(v, 9) for key, v in s.breakdown.items()}}


def toggled_ranking(runs: list[Run], inv: ModelInventory, hw: HardwareProfile) -> list[dict[str, Any]]:
    """Each run's plan with op offload on and off, predicted (no measurement of the other side)."""
    out = []
    for r in runs:
        other = toggled_offload(r)
        p_other = predict(inv, other, hw, n_prompt=max(r.n_prompt, 1), depth=r.depth).pp_tps
        p_self = predict(inv, r.plan, hw, n_prompt=max(r.n_prompt, 1), depth=r.depth).pp_tps
        on, off = (p_self, p_other) if r.plan.knobs.offload.any_enabled else (p_other, p_self)
        out.append({"index": r.index, "predicted_pp_on": round(on, 2), "predicted_pp_off": round(off, 2)})
    return out


def report(runs: list[Run], inv: ModelInventory, hw: HardwareProfile, name: str, runs_path: str,
           hw_text: str) -> dict[str, Any]:
    scored = score(runs, inv, hw)
    train, test = split_train_test(runs)
    ti = {r.index for r in train}
    pairs = offload_pairs(scored)
    worst_tg = sorted(scored, key=lambda s: -abs(s.err_tg))[:WORST]
    worst_pp = sorted(scored, key=lambda s: -abs(s.err_pp))[:WORST]
    return {
        "name": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs_file": runs_path, "fit_runs": _same_file(runs_path, FIT_RUNS), "hardware": hw_text,
        "hardware_profile": hw.to_dict(), "model": inv.name or inv.source,
        "engine_facts": asdict(LLAMACPP),
        "mape": {"all": mape(scored), "even_lines": mape(s for s in scored if s.run.index in ti),
                 "odd_lines": mape(s for s in scored if s.run.index not in ti)},
        "offload_pairs": pairs, "offload_pairs_right": sum(p["right"] for p in pairs),
        "offload_toggled": toggled_ranking(runs, inv, hw),
        "worst_tg": [s.run.index for s in worst_tg], "worst_pp": [s.run.index for s in worst_pp],
        "runs": [_row(s) for s in scored],
    }


FIT_RUNS = Path(__file__).resolve().parents[1] / "tests" / "planner" / "data" / "h100_llamacpp_runs.jsonl"


def _same_file(a: str | Path, b: Path) -> bool:
    """Whether the runs are the ones the engine constants were fitted on (their even lines)."""
    try:
        return Path(a).read_bytes() == b.read_bytes()
    except OSError:
        return False


def markdown(d: dict[str, Any]) -> str:
    m = d["mape"]
    rows = {r["index"]: r for r in d["runs"]}

    def pct(x: float) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"
    L = [f"# Cost model vs llama.cpp: {d['name']}", "",
         f"Runs: `{d['runs_file']}` ({m['all']['n']} runs); hardware profile: `{d['hardware']}` "
         f"({d['hardware_profile']['name']}); model: {d['model']}; {d['date']}.",
         "Predicted by `run --engine sim` (planner.cost) from the profile alone, no measurement of these runs.", "",
         "| runs | n | TG MAPE | PP MAPE |", "|---|---|---|---|",
         f"| all | {m['all']['n']} | {pct(m['all']['tg'])} | {pct(m['all']['pp'])} |",
         *([f"| even lines (what the engine constants were fitted on) | {m['even_lines']['n']} | "
            f"{pct(m['even_lines']['tg'])} | {pct(m['even_lines']['pp'])} |",
            f"| odd lines (held out) | {m['odd_lines']['n']} | {pct(m['odd_lines']['tg'])} | "
            f"{pct(m['odd_lines']['pp'])} |"]
           if d.get("fit_runs") else []),
         "", ("The engine constants were fitted on the even lines of this file." if d.get("fit_runs") else
              "None of these runs was used to fit the engine constants (they were fitted on the even lines of "
              "tests/planner/data/h100_llamacpp_runs.jsonl)."),
         "", "## Op offload on vs off", ""]
    pairs = d["offload_pairs"]
    if pairs:
        L += [f"Measured pairs equal but for op offload (and the load mode): {d['offload_pairs_right']} of "
              f"{len(pairs)} ranked right.", "",
              "| on (line) | off (line) | measured PP on / off | predicted PP on / off | right |",
              "|---|---|---|---|---|"]
        for p in pairs:
            L.append(f"| {p['on']} | {p['off']} | {p['measured_pp'][0]:.0f} / {p['measured_pp'][1]:.0f} | "
                     f"{p['predicted_pp'][0]:.0f} / {p['predicted_pp'][1]:.0f} | {'yes' if p['right'] else 'NO'} |")
    else:
        L.append("No measured pair differs only in op offload.")
    tog = d["offload_toggled"]
    n_on = sum(1 for t in tog if t["predicted_pp_on"] > t["predicted_pp_off"])
    L += ["", f"Every run's plan predicted both ways: op offload on is predicted faster in {n_on} of {len(tog)}.", ""]
    for title, key, err in (("TG", "worst_tg", "err_tg"), ("PP", "worst_pp", "err_pp")):
        L += [f"## Worst {title} predictions", "", "| line | measured | predicted | error | command |",
              "|---|---|---|---|---|"]
        for i in d[key]:
            r = rows[i]
            meas, pred = ((r["measured_tg_tps"], r["predicted_tg_tps"]) if title == "TG"
                          else (r["measured_pp_tps"], r["predicted_pp_tps"]))
            L.append(f"| {i} | {meas:.1f} | {pred:.1f} | {100 * r[err]:+.1f}% | `{r['command']}` |")
        L.append("")
    L += ["## Every run", "",
          "| line | ub | t | op offload | mmap | FA | TG meas | TG pred | TG err | PP meas | PP pred | PP err |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        L.append(f"| {r['index']} | {r['ubatch']} | {r['threads'] or '-'} | {'on' if r['op_offload'] else 'off'} | "
                 f"{'yes' if r['mmap'] else 'no'} | {'on' if r['flash_attn'] else 'off'} | "
                 f"{r['measured_tg_tps']:.2f} | "
                 f"{r['predicted_tg_tps']:.2f} | {100 * r['err_tg']:+.1f}% | {r['measured_pp_tps']:.0f} | "
                 f"{r['predicted_pp_tps']:.0f} | {100 * r['err_pp']:+.1f}% |")
    return "\n".join(L) + "\n"


def fit_constants(runs: list[Run], inv: ModelInventory, hw: HardwareProfile
                  ) -> tuple[dict[str, float], HardwareProfile, EngineFacts]:
    """Least squares on log(predicted / measured) of TG and PP over `runs`, in the Overheads shares and the
    EngineFacts fields (FIT_SHARES, FIT_FACTS); the other terms stay as the profile measured them."""
    import numpy as np
    from scipy.optimize import least_squares
    names = list(FIT_SHARES) + list(FIT_FACTS)
    bounds = list(FIT_SHARES.values()) + list(FIT_FACTS.values())
    x0 = [getattr(hw.overheads, k) for k in FIT_SHARES] + [getattr(LLAMACPP, k) for k in FIT_FACTS]
    x0 = [min(max(v, lo), hi) for v, (lo, hi) in zip(x0, bounds)]

    def build(x) -> tuple[HardwareProfile, EngineFacts]:
        v = dict(zip(names, (float(a) for a in x)))
        h = replace(hw, overheads=replace(hw.overheads, **{k: v[k] for k in FIT_SHARES}))
        return h, replace(LLAMACPP, **{k: v[k] for k in FIT_FACTS})

    def resid(x):
        h, f = build(x)
        sc = score(runs, inv, h, f)
        return np.array([math.log(s.pred_tg_tps / s.run.tg_tps) for s in sc if s.run.tg_tps > 0]
                        + [math.log(s.pred_pp_tps / s.run.pp_tps) for s in sc if s.run.pp_tps > 0])
    res = least_squares(resid, x0, bounds=([b[0] for b in bounds], [b[1] for b in bounds]))
    h, f = build(res.x)
    return dict(zip(names, (round(float(a), 4) for a in res.x))), h, f


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="runs JSONL (llama_bench_args, env, pp_tps, tg_tps, peak_vram_mib)")
    ap.add_argument("--hardware", required=True, help="hardware preset name or profile JSON (calibrate --out)")
    ap.add_argument("--model", help="the runs' model: .gguf or preset:NAME[:QUANT] (default: the synthetic "
                                    "Qwen3-30B-A3B-shaped Q4_0 model of benchmarks/llamacpp_gpu.py)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "reported"), help="output folder")
    ap.add_argument("--name", default="h100", help="report name: cost_model_<name>.{md,json}")
    ap.add_argument("--fit", action="store_true", help="refit the engine constants on the even lines and print "
                                                       "them with the held-out MAPE (needs scipy); writes nothing")
    ap.add_argument("--fit-depth", metavar="DEPTH_RUNS", help="refit the attention-at-depth constants on the even "
                    "lines of DEPTH_RUNS and of --runs together, print them with the held-out MAPE; writes nothing")
    ap.add_argument("--restamp", action="store_true", help="replace the profile's llama.cpp shares with the "
                    "committed planner.hardware.LLAMACPP_SHARES (what calibrate writes now, for a profile it wrote "
                    "before a refit)")
    ap.add_argument("--fit-also", metavar="RUNS", help="with --fit: every line of RUNS joins the fitting set (runs "
                    "the shared file lacks: all-GPU, whole layers on the CPU, e.g. llamacpp_gpu_runs.jsonl)")
    args = ap.parse_args(argv)
    inv = load_model(args.model)
    hw = load_hardware(args.hardware)
    if args.restamp:
        hw = restamped(hw)
    runs = read_runs(args.runs, inv)
    if args.fit_depth:
        deep = [r for r in read_runs(args.fit_depth, inv) if r.depth > 0]
        (dtr, dte), (rtr, rte) = split_train_test(deep), split_train_test(runs)
        consts, f = fit_depth(dtr + rtr, inv, hw)
        print(json.dumps(consts, indent=2))
        for label, rs in (("depth runs, fitted on (even lines)", dtr), ("depth runs, held out (odd lines)", dte),
                          ("--runs, even lines", rtr), ("--runs, odd lines", rte)):
            m = mape(score(rs, inv, hw, f))
            print(f"{label}: n {m['n']}, TG MAPE {100 * m['tg']:.1f}%, PP MAPE {100 * m['pp']:.1f}%")
        return 0
    if args.fit:
        train, test = split_train_test(runs)
        also = read_runs(args.fit_also, inv) if args.fit_also else []
        consts, h, f = fit_constants(train + also, inv, hw)
        print(json.dumps(consts, indent=2))
        for label, rs in (("fitted on (even lines)", train), ("held out (odd lines)", test), ("all", runs),
                          *((("--fit-also runs (fitted on)", also),) if also else ())):
            m = mape(score(rs, inv, h, f))
            print(f"{label}: n {m['n']}, TG MAPE {100 * m['tg']:.1f}%, PP MAPE {100 * m['pp']:.1f}%")
        return 0
    d = report(runs, inv, hw, args.name, args.runs, args.hardware)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cost_model_{args.name}.json").write_text(json.dumps(d, indent=1) + "\n")
    (out / f"cost_model_{args.name}.md").write_text(markdown(d))
    m = d["mape"]
    print(f"{m['all']['n']} runs: TG MAPE {100 * m['all']['tg']:.1f}%, PP MAPE {100 * m['all']['pp']:.1f}% "
          f"(even lines {100 * m['even_lines']['tg']:.1f}% / {100 * m['even_lines']['pp']:.1f}%, odd lines "
          f"{100 * m['odd_lines']['tg']:.1f}% / {100 * m['odd_lines']['pp']:.1f}%); op offload pairs right "
          f"{d['offload_pairs_right']}/{len(d['offload_pairs'])}; wrote {out}/cost_model_{args.name}.{{md,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
