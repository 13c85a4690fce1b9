"""explain under mainline's default --fit (issue 'first hour' 5): a command that gives no expert overrides and does
not fit is explained as llama.cpp's fit would run it (experts to RAM, -fitt MiB kept free), not as an
out-of-memory; the memory the fit leaves unused is pointed out."""
from __future__ import annotations

from offload_tuner.app.explain import explain_outcome
from offload_tuner.app.requests import ExplainRequest
from planner.hardware import GiB, MiB

M = "preset:Qwen3-30B-A3B"


def explain(*args: str, gpu: str = "8GiB"):
    return explain_outcome(ExplainRequest(model=M, args=args, gpu=gpu))


def codes(o) -> list[str]:
    return [w.split()[0] for w in o.warnings]


def test_a_command_that_does_not_fit_is_explained_as_the_fit_runs_it():
    o = explain("-ngl", "99", "-c", "16384", "-fa", "on")
    assert "W100" not in codes(o) and "W009" not in codes(o) and {"W101", "W102"} <= set(codes(o))
    gpu = o.mem.devices["CUDA0"].total
    assert 8 * GiB - 1024 * MiB - 400 * MiB < gpu <= 8 * GiB - 1024 * MiB      # filled to the -fitt margin
    moved = [n for n, d in o.plan.assignment.items() if "_exps" in n and d == "CPU"]
    assert moved and o.plan.label == "fitted by llama.cpp"
    # a smaller -fitt keeps less free
    o512 = explain("-ngl", "99", "-c", "16384", "-fa", "on", "-fitt", "512")
    assert o512.mem.devices["CUDA0"].total > gpu and o512.mem.devices["CUDA0"].total <= 8 * GiB - 512 * MiB


def test_no_fit_when_it_is_off_or_the_experts_are_placed():
    assert "W100" in codes(explain("-ngl", "99", "-c", "16384", "-fa", "on", "-fit", "off"))
    placed = explain("-ngl", "99", "-c", "16384", "-fa", "on", "-ncmoe", "10")
    assert "W101" not in codes(placed) and "W100" in codes(placed)
    # it fits as written: nothing changes
    fits = explain("-ngl", "99", "-c", "4096", "-fa", "on", gpu="48GiB")
    assert not {"W100", "W101"} & set(codes(fits)) and fits.plan.label == "explained"
