"""Load a benchmark script (benchmarks/NAME.py) in a test: the scripts are not package members."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_benchmark(name: str) -> Any:
    """benchmarks/NAME.py as the module NAME (a script, not a package member: the benchmarks import each other by
    that name). Registered in sys.modules; the caller removes it (the `bench_script` fixture does)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

