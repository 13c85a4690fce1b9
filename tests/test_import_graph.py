"""The layers the tree shows, held by parsing the source (issue 13): planner/ never imports runtime/ (the engines
and the CLI's runtime commands are named in planner/engines.py and imported by name) nor torch at module level;
the tuner (planner/tuner/) imports neither runtime/ nor argparse, itself or through the planner modules it uses.
The application layer (planner/app/) sits under the CLI and the service: nothing imports planner/cli; planner/cli
and planner/service never import each other; the service and the app layer reach no argparse; the one import of
planner/service from outside it is the app's serve use case, inside its function (planner/app/serve.py).
Every import counts, at any depth (inside functions too), relative ones resolved to the module they name.
Sizes (issue 28): no module over 800 lines and no function over 80 in planner/ and runtime/ unless it says why it is
one piece (LONG_MODULES; a `# one piece:` comment above the def)."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANNER = ROOT / "planner"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> Iterator[tuple[str, int, bool]]:
    """(absolute module name, line, at module level) of every import in `source`; `module` is the file's own
    dotted name, for resolving relative imports. Module level: not inside a function (class bodies and
    if/try blocks at the top run at import time, so they count as module level)."""
    package = module if is_package else module.rpartition(".")[0]

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def walk(node: ast.AST, top: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, top
            elif isinstance(child, ast.ImportFrom):
                name = resolve(child)
                yield name, child.lineno, top
                for alias in child.names:     # `from . import x` imports the module x
                    yield f"{name}.{alias.name}", child.lineno, top
            yield from walk(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.Lambda)))
    yield from walk(ast.parse(source), True)


def names(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


SERVE_USE_CASE = "planner.app.serve"     # starts the service: the one module outside it that imports it, lazily


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What breaks the layering in one module's source."""
    out = []
    for name, line, top in imports(source, module, is_package):
        if names(name, "runtime"):
            out.append(f"{module}:{line} imports {name} (planner never imports runtime/: name it in planner/engines)")
        if top and names(name, "torch"):
            out.append(f"{module}:{line} imports torch at module level (only inside a function, and only in runtime/)")
        if any(names(module, m) for m in ("planner.tuner", "planner.app", "planner.service")) and \
                names(name, "argparse"):
            out.append(f"{module}:{line} imports argparse (only the CLI parses; the layers under it and the service "
                       "take typed requests)")
        if names(name, "planner.cli") and not names(module, "planner.cli"):
            out.append(f"{module}:{line} imports {name} (nothing imports the CLI: the use cases are in planner/app)")
        if names(name, "planner.service") and not names(module, "planner.service") and \
                (module != SERVE_USE_CASE or top):
            out.append(f"{module}:{line} imports {name} (nothing imports the service but planner/app/serve.py, inside "
                       "run_server)")
    return out


def planner_sources() -> dict[str, tuple[Path, str]]:
    return {module_name(p): (p, p.read_text()) for p in sorted(PLANNER.rglob("*.py"))}


def test_planner_never_imports_runtime_nor_torch_at_module_level():
    bad = [v for mod, (p, src) in planner_sources().items() for v in violations(src, mod, p.name == "__init__.py")]
    assert not bad, "\n".join(bad)


def reached_from(root: str) -> tuple[dict[str, set[str]], dict[str, str]]:
    """(planner's import graph, {module: the module it was reached from}) for everything `root`'s modules import,
    followed through planner's own modules."""
    sources = planner_sources()
    graph = {mod: {n for n, _, _ in imports(src, mod, p.name == "__init__.py")} for mod, (p, src) in sources.items()}
    seen: dict[str, str] = {}
    todo = [(m, m) for m in sources if names(m, root)]
    while todo:
        mod, via = todo.pop()
        if mod in seen or mod not in graph:
            continue
        seen[mod] = via
        todo += [(n, mod) for n in graph[mod]]
    return graph, seen


def test_tuner_reaches_neither_runtime_nor_argparse_through_planner():
    """The tuner's imports followed through planner's own modules: none of those imports runtime or argparse."""
    graph, seen = reached_from("planner.tuner")
    bad = [f"{mod} (reached from {via}) imports {n}" for mod, via in seen.items() for n in graph[mod]
           if names(n, "runtime") or names(n, "argparse")]
    assert not bad, "\n".join(bad)
    assert "planner.tuner.search" in seen and "planner.plan" in seen     # the walk did follow the tuner's imports


def test_the_service_reaches_neither_the_cli_nor_argparse_through_planner():
    """The service's imports followed through planner's own modules (the app layer, the tuner, the core): none
    imports argparse or the CLI, so a JSON body never goes through an argument parser."""
    graph, seen = reached_from("planner.service")
    bad = [f"{mod} (reached from {via}) imports {n}" for mod, via in seen.items() for n in graph[mod]
           if names(n, "argparse") or names(n, "planner.cli")]
    assert not bad, "\n".join(bad)
    assert "planner.app.requests" in seen and "planner.app.tune" in seen     # the walk did go through the app


def test_importing_the_planner_loads_no_runtime_nor_torch():
    """The same, as Python sees it: the CLI and the tuner import without runtime/ or torch (a fresh interpreter)."""
    code = ("import sys, planner.cli, planner.tuner.search, planner.tuner.report, planner.service.app\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'runtime', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing the planner loaded {out.stdout.strip()}"


def test_the_cli_and_the_app_layer_load_no_service():
    """The CLI reaches the service only when `serve` runs: importing it (and the app layer) loads neither
    planner/service nor FastAPI."""
    code = ("import sys, planner.cli, planner.app\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fastapi' or m.startswith('planner.service')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing the CLI loaded {out.stdout.strip()}"


def test_the_check_catches_each_kind_of_violation():
    """The checker itself: each way of breaking the layers is caught, and the allowed forms are not."""
    assert violations("from runtime.sim import SimEngine\n", "planner.cli")
    assert violations("def f():\n    import runtime.gpumem\n", "planner.cli")               # at any depth
    assert violations("def f():\n    from runtime import synth\n", "planner.cli")
    assert violations("from ...runtime import sim\n", "planner.service.app")                # relative, resolved
    assert violations("import torch\n", "planner.memory")
    assert violations("try:\n    from torch import nn\nexcept ImportError:\n    pass\n", "planner.memory")
    assert violations("import argparse\n", "planner.tuner.search")
    assert violations("def f():\n    from argparse import Namespace\n", "planner.tuner.space")
    assert not violations("def f():\n    import torch\n", "planner.memory")                  # lazily: allowed
    assert not violations("import argparse\n", "planner.cli")                               # the CLI parses
    assert not violations('ENGINES = {"sim": "runtime.sim:SimEngine"}\n', "planner.engines")  # a name, not an import
    assert not violations("from ..memory import estimate\n", "planner.tuner.search")
    # the app layer, the CLI and the service
    assert violations("import argparse\n", "planner.service.bodies")                      # the service parses no argv
    assert violations("def f():\n    from argparse import Namespace\n", "planner.app.plan")
    assert violations("from ..cli import main\n", "planner.service.app")                 # service -> CLI
    assert violations("def f():\n    from ..cli.common import request\n", "planner.service.views")
    assert violations("from planner.cli import build_parser\n", "planner.app.tune")        # nothing imports the CLI
    assert violations("from ..service.app import serve\n", "planner.cli.serve")           # CLI -> service
    assert violations("def f():\n    from ..service import app\n", "planner.cli.serve")
    assert violations("from ..service.app import serve\n", "planner.app.serve")           # at module level: no
    assert violations("def f():\n    from ..service.app import serve\n", "planner.app.plan")   # another use case
    assert violations("from . import service\n", "planner", is_package=True)
    assert not violations("def f():\n    from ..service.app import serve\n", "planner.app.serve")   # the one way
    assert not violations("from ..app.requests import PlanRequest\n", "planner.service.bodies")
    assert not violations("from ..app.plan import plan_outcome\n", "planner.cli.plan")
    assert not violations("from .security import PathPolicy\n", "planner.service.app")    # within the service
    assert not violations("from . import tune\n", "planner.cli", is_package=True)


# runtime/ depends on planner's core and the engine protocol only: the engines never reach up into the tuner, the
# CLI or the service (what they share with the tuner, EngineFit and the tables, lives below both)
RUNTIME_MAY_NOT = ("planner.tuner", "planner.cli", "planner.service", "planner.app")


def runtime_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    return [f"{module}:{line} imports {name} (runtime/ depends on planner's core and planner.engine only)"
            for name, line, _ in imports(source, module, is_package) if any(names(name, r) for r in RUNTIME_MAY_NOT)]


def test_runtime_never_imports_the_tuner_the_cli_or_the_service():
    bad = [v for p in sorted((ROOT / "runtime").rglob("*.py"))
           for v in runtime_violations(p.read_text(), module_name(p), p.name == "__init__.py")]
    assert not bad, "\n".join(bad)


def argparse_outside_main(source: str) -> list[int]:
    """Lines importing argparse outside an `if __name__ == "__main__":` block (a module run as a script may parse
    its own argv there; the commands' flags are parsed in planner/cli)."""
    def is_main_guard(node: ast.AST) -> bool:
        return isinstance(node, ast.If) and all(w in ast.unparse(node.test) for w in ("__name__", "__main__"))

    def is_argparse(node: ast.AST) -> bool:
        if isinstance(node, ast.Import):
            return any(names(a.name, "argparse") for a in node.names)
        return isinstance(node, ast.ImportFrom) and not node.level and names(node.module or "", "argparse")

    def walk(node: ast.AST) -> Iterator[int]:
        for child in ast.iter_child_nodes(node):
            if is_main_guard(child):
                continue
            if is_argparse(child):
                yield child.lineno
            yield from walk(child)
    return list(walk(ast.parse(source)))


def test_runtime_parses_no_command_line():
    """runtime/ offers plain functions with typed arguments; the CLI parses the flags (planner/cli/runtime_cmds.py)."""
    bad = [f"{module_name(p)}:{line} imports argparse (parse the flags in planner/cli; runtime/ takes typed arguments)"
           for p in sorted((ROOT / "runtime").rglob("*.py")) for line in argparse_outside_main(p.read_text())]
    assert not bad, "\n".join(bad)
    assert argparse_outside_main("def f():\n    from argparse import Namespace\n") == [2]
    assert not argparse_outside_main('if __name__ == "__main__":\n    import argparse\n')


def test_the_runtime_check_catches_a_planted_import():
    assert runtime_violations("from planner.tuner.baselines import EngineFit\n", "runtime.llamacpp")
    assert runtime_violations("def f():\n    from planner.tuner.report import table\n", "runtime.run")
    assert runtime_violations("from planner import cli\n", "runtime.x")
    assert not runtime_violations("from planner.engine import EngineFit\n", "runtime.llamacpp")
    assert not runtime_violations("from planner.tables import table\n", "runtime.run")


# ---- sizes: one idea per module, functions a reader can hold (issue 28) ---------------------------------------------

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
ONE_PIECE = "# one piece:"      # the comment just above a longer def that says why it is not split
# modules kept whole past MAX_MODULE_LINES, each with why (none now: memory.py, the last, split into residency.py,
# ik_pool.py and itself)
LONG_MODULES: dict[str, str] = {}


def too_long(source: str, path: str, long_modules: Mapping[str, str] = LONG_MODULES) -> list[str]:
    """A module over MAX_MODULE_LINES not in `long_modules`, and functions over MAX_FUNCTION_LINES (def to last line,
    decorators included) without a ONE_PIECE comment in the comment lines right above them."""
    lines = source.splitlines()
    out = []
    if len(lines) > MAX_MODULE_LINES and path not in long_modules:
        out.append(f"{path}: {len(lines)} lines, over {MAX_MODULE_LINES} (split it along a seam, or say in "
                   "LONG_MODULES why it is one piece)")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        n = (node.end_lineno or node.lineno) - first + 1
        if n <= MAX_FUNCTION_LINES:
            continue
        above = []
        i = first - 2
        while i >= 0 and lines[i].lstrip().startswith("#"):
            above.append(lines[i].strip())
            i -= 1
        if not any(c.startswith(ONE_PIECE) for c in above):
            out.append(f"{path}:{node.lineno} {node.name} is {n} lines, over {MAX_FUNCTION_LINES} (split it, or say "
                       f"why it is one piece in a '{ONE_PIECE}' comment above it)")
    return out


def test_no_long_module_or_function_in_planner_and_runtime():
    bad = [v for root in ("planner", "runtime") for p in sorted((ROOT / root).rglob("*.py"))
           for v in too_long(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not bad, "\n".join(bad)
    assert all((ROOT / path).is_file() for path in LONG_MODULES)       # no stale entry


def test_the_size_check_catches_a_planted_long_module_and_function():
    long_fn = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert too_long(long_fn, "planner/x.py")
    assert not too_long(f"{ONE_PIECE} the steps share every local\n" + long_fn, "planner/x.py")
    assert not too_long(f"{ONE_PIECE} why, said over\n# two lines\n" + long_fn, "planner/x.py")
    assert too_long("# a comment that says nothing of why\n" + long_fn, "planner/x.py")
    assert too_long("class C:\n    @property\n" + "".join("    " + ln + "\n" for ln in long_fn.splitlines()),
                    "planner/x.py")                                                        # methods too
    assert not too_long("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1), "planner/x.py")
    long_module = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert too_long(long_module, "planner/x.py")
    assert not too_long(long_module, "planner/x.py", {"planner/x.py": "why"})
