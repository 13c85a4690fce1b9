"""planner/engine_registry.py: each name resolves to a factory in runtime/ that makes an Engine, the
traits are what the tuner asks instead of names, and no code outside the registry branches on an engine's name."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from planner import engine_registry
from planner.engine_contract import Engine
from planner.errors import InputError
from planner.hardware import resolve
from planner.options import EngineOptions

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(engine_registry.ENGINES))
def test_every_engine_factory_resolves(name):
    spec = engine_registry.spec(name)
    assert spec.name == name and engine_registry.module_found(spec.module)
    assert callable(engine_registry._load(spec.factory))


def test_make_engine_builds_sim_with_its_traits():
    hw = resolve("rtx4090-ddr5", None)
    engine = engine_registry.make_engine(EngineOptions(engine="sim", model="preset:Qwen3-30B-A3B"), hw)
    assert isinstance(engine, Engine) and engine.name == "sim"
    assert engine_registry.traits_of(engine) == engine_registry.spec("sim").traits
    assert not engine_registry.traits_of(engine).measured and engine_registry.traits_of(engine).memory_error_prior == 0


def test_unknown_and_unavailable_engines_are_one_line(monkeypatch):
    hw = resolve("rtx4090-ddr5", None)
    with pytest.raises(InputError, match="unknown engine 'nope': give one of sim, torch, llamacpp, llamaserver"):
        engine_registry.make_engine(EngineOptions(engine="nope", model="m"), hw)
    monkeypatch.setitem(engine_registry.ENGINES, "torch",
                        replace(engine_registry.ENGINES["torch"], factory="runtime.gone:make"))
    with pytest.raises(InputError, match="not available yet"):
        engine_registry.make_engine(EngineOptions(engine="torch", model="m"), hw)
    monkeypatch.setitem(engine_registry.ENGINES, "torch", replace(engine_registry.ENGINES["torch"],
                                                          factory="runtime.sim:from_options"))
    assert engine_registry.make_engine(EngineOptions(engine="torch", model="m"), hw).name == "sim"


def test_a_gpu_engine_says_no_gpu_in_its_factory_without_loading_torch():
    """The torch engine's factory checks for a CUDA GPU itself (the registry knows nothing of GPUs) and says so in
    one line, before torch is imported (a fresh interpreter: the demo's install has no torch)."""
    from runtime.gpumem import cuda_available
    if cuda_available():
        pytest.skip("this machine has a CUDA GPU: the torch engine starts")
    code = ("import sys\nfrom planner import engine_registry\nfrom planner.errors import InputError\n"
            "from planner.hardware import resolve\nfrom planner.options import EngineOptions\n"
            "try:\n    engine_registry.make_engine(EngineOptions(engine='torch', model='m'),\n"
            "                                resolve('rtx4090-ddr5', None))\n"
            "except InputError as e:\n    print(e)\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    said, torch_loaded = out.stdout.strip().splitlines()
    assert said.startswith("engine torch measures plans on CUDA GPUs and this machine has none; use --engine sim")
    assert torch_loaded == "False"


def test_an_unregistered_engine_object_is_taken_for_a_measured_one():
    class Stand(Engine):
        name = "someone-elses"

        def measure(self, inv, plan, workload):
            raise AssertionError("not run")
    assert engine_registry.traits_of(Stand()) == engine_registry.UNREGISTERED and engine_registry.UNREGISTERED.measured


def test_an_engine_declares_its_protocol_and_lacks_nothing_it_is_asked():
    """The capabilities are the base class's (issue 42 item 4): an engine that lacks one answers its default, and
    one without `measure` cannot be made at all."""
    class Bare(Engine):
        name = "bare"

        def measure(self, inv, plan, workload):
            raise AssertionError("not run")
    e = Bare()
    assert (e.run_context(None), e.own_fit(None, None, {}), e.shell_command(None, None, None)) == (None, None, None)
    assert not e.predicts_memory and e.op_offload_per_class and e.dialect is None
    with pytest.raises(InputError, match="bare engine measures plans, not a command line"):
        e.measure_args(["-m", "x.gguf"], None)

    class NoMeasure(Engine):
        name = "none"
    with pytest.raises(TypeError, match="abstract"):
        NoMeasure()


# an engine name in a comparison: `x.name == "sim"`, `engine != "llamacpp"`, `in ("sim", ...)`
_NAME_CHECK = re.compile(r"""(==|!=|\bin\b)\s*\(?\s*["'](sim|torch|llamacpp|llamaserver)["']""")


def test_no_code_branches_on_an_engine_name():
    hits = []
    for folder in ("planner", "tuner", "runtime", "offload_tuner"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "engine_registry.py" and path.parent.name == "planner":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if _NAME_CHECK.search(line.split("#")[0]):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "ask planner.engine_registry.traits_of(engine) instead:\n" + "\n".join(hits)


def test_the_name_check_finder_finds_one():
    assert _NAME_CHECK.search('if engine.name == "sim":') and _NAME_CHECK.search("x in ('torch', 'sim')")
    assert not _NAME_CHECK.search('name: str = "sim"')
