"""`plan`'s first answer is the best we know (issue 40, item 1): with every default it ranks by the workload's
predicted mean request time, the chat workload unless one is given, as `tune` does; and a pick that gives up more
than half of an alternative's PP for under 5% of TG says so in its first line (tune's rule, tuner/served.py).

The acceptance: over every model preset at 8, 16 and 24 GiB and every workload preset, the default pick is never
dominated by one of its alternatives (one at >= 0.98x its TG with >= 2x its PP at no more VRAM). The use case is
called in-process (plan is ~0.3 s a call); the fast test takes one workload per preset and size, turning through
the presets, so every preset and size and every workload is covered; the slow one takes every combination."""
from __future__ import annotations

import json
import re

import pytest

from offload_tuner.app.plan import plan_outcome
from offload_tuner.app.requests import PlanRequest
from offload_tuner.cli import main
from planner.presets import preset_names
from planner.workload import PRESETS

MODELS = preset_names()
SIZES = (8, 16, 24)
WORKLOADS = tuple(PRESETS)


def _gpu_bytes(s) -> int:
    return sum(m.total for d, m in s.memory.devices.items() if d != "CPU")


def _dominating(model: str, gib: int, workload: str) -> list[str]:
    """The alternatives that dominate plan's default pick (none is the acceptance); chat by the default itself."""
    o = plan_outcome(PlanRequest(model=f"preset:{model}", gpu=f"{gib}GiB",
                                 **({} if workload == "chat" else {"workload": workload})))
    assert o.objective == f"time, workload {workload}" and o.workload == workload
    best = o.ranked[0]
    return [f"{model} {gib} GiB {workload}: pick {best.plan.label} PP {best.pp_tps:.1f} TG {best.tg_tps:.2f}, "
            f"dominated by {s.plan.label} PP {s.pp_tps:.1f} TG {s.tg_tps:.2f}"
            for s in o.ranked[1:] if s.tg_tps >= 0.98 * best.tg_tps and s.pp_tps >= 2 * best.pp_tps
            and _gpu_bytes(s) <= _gpu_bytes(best)]


@pytest.mark.parametrize("model", MODELS)
def test_the_default_pick_is_never_dominated(model):
    i = MODELS.index(model)
    bad = [x for j, gib in enumerate(SIZES) for x in _dominating(model, gib, WORKLOADS[(i + j) % len(WORKLOADS)])]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_the_default_pick_is_never_dominated_on_any_workload(model):
    bad = [x for gib in SIZES for w in WORKLOADS for x in _dominating(model, gib, w)]
    assert not bad, "\n".join(bad)


def _plan_json(capsys, *extra: str) -> dict:
    assert main(["plan", "preset:GLM-4.5-Air", "--gpu", "16GiB", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_default_ranks_by_the_chat_workloads_request_time(capsys):
    # the case: GLM-4.5-Air at 16 GiB ranked by TG picked op offload off (PP 18.3 t/s, TG 12.98) over
    # op offload on (PP 209.6, TG 12.88); by the chat workload's request time op offload is on
    out = _plan_json(capsys)
    assert out["objective"] == "time, workload chat" and out["workload"] == "chat"
    assert "--no-op-offload" not in out["commands"]["llama-server"]
    assert "--no-op-offload" in _plan_json(capsys, "--objective", "tg")["commands"]["llama-server"]
    assert out["gives_up"] is None
    times = [out["predicted"]["mean_request_s"]] + [a["mean_request_s"] for a in out["alternatives"]]
    assert times == sorted(times)
    assert PlanRequest(model="m").objective == "time"


GIVES_UP = re.compile(r"gives up PP (\d+\.\d\d)x the best alternative's \((\d+\.\d) vs (\d+\.\d) t/s: (.+), "
                      r"op offload (on|off|moe off|partly off), (mmap|no mmap)\) for TG ([+-]\d+\.\d)%")


def test_a_pick_that_gives_up_most_of_the_pp_says_so_first(capsys):
    out = _plan_json(capsys, "--objective", "tg")
    assert out["objective"] == "tg" and "workload" not in out and "mean_request_s" not in out["predicted"]
    m = GIVES_UP.fullmatch(out["gives_up"])
    assert m, out["gives_up"]
    best = out["predicted"]
    alt = max((a for a in out["alternatives"] if a["tg_tps"] >= 0.95 * best["tg_tps"]), key=lambda a: a["pp_tps"])
    assert float(m[1]) < 0.5 and float(m[2]) == round(best["pp_tps"], 1) and float(m[3]) == round(alt["pp_tps"], 1)
    assert m[4] == alt["label"] and (m[5] == "on") == alt["op_offload"] and (m[6] == "mmap") == alt["mmap"]
    assert float(m[7]) == round(100 * (best["tg_tps"] / alt["tg_tps"] - 1), 1)
    assert main(["plan", "preset:GLM-4.5-Air", "--gpu", "16GiB", "--objective", "tg"]) == 0
    pick = [line for line in capsys.readouterr().out.splitlines() if line.startswith("best (")]
    assert pick == [pick[0]] and pick[0].startswith(f"best (tg): {out['gives_up']}: ")


def test_a_workload_under_tg_sizes_the_context_and_shows_its_times_but_tg_ranks(capsys):
    out = _plan_json(capsys, "--objective", "tg", "--workload", "rag")
    assert out["objective"] == "tg" and out["workload"] == "rag"
    assert "-c 16640" in out["commands"]["llama-server"]          # rag's 16384 + 250 tokens, whole 256s
    tgs = [out["predicted"]["tg_tps"]] + [a["tg_tps"] for a in out["alternatives"]]
    assert tgs == sorted(tgs, reverse=True) and "mean_request_s" in out["predicted"]
