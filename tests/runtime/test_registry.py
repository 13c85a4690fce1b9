"""planner/engines.py names what the planner calls in runtime/ by string; each name must resolve to what it says."""
from __future__ import annotations

import pytest

from planner import engines
from planner.engine import Engine


@pytest.mark.parametrize("name", sorted(engines.RUNTIME))
def test_every_runtime_command_resolves(name):
    assert callable(engines.runtime(name))


@pytest.mark.parametrize("name", sorted(engines.ENGINES))
def test_every_engine_resolves_to_an_engine_class(name):
    cls = engines.engine_class(name)
    assert isinstance(cls, type) and hasattr(cls, "measure")
    assert engines.module_found(engines.engine_module(name))


def test_sim_from_the_registry_keeps_the_contract():
    from planner.hardware import resolve
    assert isinstance(engines.engine_class("sim")(resolve("rtx4090-ddr5", None)), Engine)
