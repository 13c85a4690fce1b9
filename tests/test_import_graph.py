"""The layers the tree shows, held by parsing the source (issues 13 and 42). Four folders:

    planner/        the core (model, GGUF, memory, cost, placements, flags, the engine protocol and registry)
    tuner/          the autotuner               imports planner/ only
    runtime/        the engines                 imports planner/ only (the engines come in through the registry)
    offload_tuner/  app/, cli/, service/        imports all three, runtime/ only inside a function

planner/ imports none of the others; nothing but the CLI imports offload_tuner/cli; the service never imports the
CLI; nothing imports the service but the CLI's serve command, inside its function (offload_tuner/cli/serve.py);
no torch at module level outside runtime/; the tuner, the app layer and the service reach no argparse.
Every import counts, at any depth (inside functions too), relative ones resolved to the module they name.
No import circle anywhere in the product, no read of another product module's private member, no getattr/hasattr
probe of an engine's protocol (the tuner's helpers take the Measurer, tuner/measurer.py; issue 42 items 2, 4, 9).
Sizes (issue 28): no module over 800 lines and no function over 80 in the product unless it says why it is
one piece (LONG_MODULES; a `# one piece:` comment above the def)."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# each product folder and the product folders it may import (itself always); "lazy": only inside a function
FOLDERS: dict[str, dict[str, str]] = {
    "planner": {},
    "tuner": {"planner": "always"},
    "runtime": {"planner": "always"},
    "offload_tuner": {"planner": "always", "tuner": "always", "runtime": "lazy"},
}
NO_ARGPARSE = ("planner", "tuner", "offload_tuner.app", "offload_tuner.service")   # only the CLI parses argv


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


SERVE_COMMAND = "offload_tuner.cli.serve"    # starts the service: the one module outside it that imports it, lazily


def folder_of(module: str) -> str | None:
    return next((f for f in FOLDERS if names(module, f)), None)


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What breaks the layering in one module's source."""
    out = []
    mine = folder_of(module)
    for name, line, top in imports(source, module, is_package):
        theirs = folder_of(name)
        if mine and theirs and theirs != mine:
            how = FOLDERS[mine].get(theirs)
            if how is None:
                may = ", ".join(FOLDERS[mine]) or "none of the others"
                out.append(f"{module}:{line} imports {name} ({mine}/ may import {may})")
            elif how == "lazy" and top:
                out.append(f"{module}:{line} imports {name} at module level ({theirs}/ only inside a function)")
        if top and names(name, "torch") and mine != "runtime":
            out.append(f"{module}:{line} imports torch at module level (only inside a function, and only in runtime/)")
        if any(names(module, m) for m in NO_ARGPARSE) and names(name, "argparse"):
            out.append(f"{module}:{line} imports argparse (only the CLI parses; the layers under it and the service "
                       "take typed requests)")
        if names(name, "offload_tuner.cli") and not names(module, "offload_tuner.cli"):
            out.append(f"{module}:{line} imports {name} (nothing imports the CLI: the use cases are in "
                       "offload_tuner/app)")
        if (names(name, "offload_tuner.service") and not names(module, "offload_tuner.service")
                and (module != SERVE_COMMAND or top)):
            out.append(f"{module}:{line} imports {name} (nothing imports the service but offload_tuner/cli/serve.py, "
                       "inside cmd_serve)")
    return out


def product_sources() -> dict[str, tuple[Path, str]]:
    return {module_name(p): (p, p.read_text()) for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def test_every_folder_keeps_its_layer():
    bad = [v for mod, (p, src) in product_sources().items() for v in violations(src, mod, p.name == "__init__.py")]
    assert not bad, "\n".join(bad)


def test_every_folder_says_what_it_is():
    """Each package's first docstring line exists (what the folder is, read by anyone opening it)."""
    for folder in (*FOLDERS, "offload_tuner/app", "offload_tuner/cli", "offload_tuner/service", "planner/flags",
                   "runtime/torch_engine"):
        doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, folder


def reached_from(root: str) -> tuple[dict[str, set[str]], dict[str, str]]:
    """(the product's import graph, {module: the module it was reached from}) for everything `root`'s modules
    import, followed through the product's own modules."""
    sources = product_sources()
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
    graph, seen = reached_from("tuner")
    bad = [f"{mod} (reached from {via}) imports {n}" for mod, via in seen.items() for n in graph[mod]
           if names(n, "runtime") or names(n, "argparse")]
    assert not bad, "\n".join(bad)
    assert "tuner.search" in seen and "planner.plan" in seen     # the walk did follow the tuner's imports


def test_the_service_reaches_neither_the_cli_nor_argparse_through_planner():
    """The service's imports followed through planner's own modules (the app layer, the tuner, the core): none
    imports argparse or the CLI, so a JSON body never goes through an argument parser."""
    graph, seen = reached_from("offload_tuner.service")
    bad = [f"{mod} (reached from {via}) imports {n}" for mod, via in seen.items() for n in graph[mod]
           if names(n, "argparse") or names(n, "offload_tuner.cli")]
    assert not bad, "\n".join(bad)
    assert "offload_tuner.app.requests" in seen and "offload_tuner.app.tune" in seen     # the walk went through the app


def test_importing_the_planner_loads_no_runtime_nor_torch():
    """The same, as Python sees it: the CLI and the tuner import without runtime/ or torch (a fresh interpreter)."""
    code = ("import sys, offload_tuner.cli, tuner.search, tuner.report, offload_tuner.service.app\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'runtime', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing the planner loaded {out.stdout.strip()}"


def test_the_cli_and_the_app_layer_load_no_service():
    """The CLI reaches the service only when `serve` runs: importing it (and the app layer) loads neither
    offload_tuner/service nor FastAPI."""
    code = ("import sys, offload_tuner.cli, offload_tuner.app\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.split('.')[0] == 'fastapi' or m.startswith('offload_tuner.service')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing the CLI loaded {out.stdout.strip()}"


def test_the_check_catches_each_kind_of_violation():
    """The checker itself: each way of breaking the layers is caught, and the allowed forms are not."""
    assert violations("from runtime.sim import SimEngine\n", "offload_tuner.cli")
    assert violations("def f():\n    import runtime.gpumem\n", "planner.memory")                  # at any depth
    assert violations("def f():\n    from runtime import synth\n", "tuner.search")
    assert violations("def f():\n    from tuner.search import Tuner\n", "planner.engine_registry")   # the core: none
    assert violations("from offload_tuner.app.requests import PlanRequest\n", "tuner.search")   # tuner: planner only
    assert not violations("def f():\n    import runtime.gpumem\n", "offload_tuner.cli")          # the app: lazily
    assert not violations("from tuner.search import Tuner\n", "offload_tuner.app.tune")
    assert violations("from ...runtime import sim\n", "offload_tuner.service.app")                # relative, resolved
    assert violations("import torch\n", "planner.memory")
    assert violations("try:\n    from torch import nn\nexcept ImportError:\n    pass\n", "planner.memory")
    assert violations("import argparse\n", "tuner.search")
    assert violations("def f():\n    from argparse import Namespace\n", "tuner.space")
    assert not violations("def f():\n    import torch\n", "planner.memory")                  # lazily: allowed
    assert not violations("import argparse\n", "offload_tuner.cli")                               # the CLI parses
    assert not violations('ENGINES = {"sim": "runtime.sim:SimEngine"}\n', "planner.engine_registry")   # a name only
    assert not violations("from ..memory import estimate\n", "tuner.search")
    # the app layer, the CLI and the service
    assert violations("import argparse\n", "offload_tuner.service.bodies")           # the service parses no argv
    assert violations("def f():\n    from argparse import Namespace\n", "offload_tuner.app.plan")
    assert violations("from ..cli import main\n", "offload_tuner.service.app")                 # service -> CLI
    assert violations("def f():\n    from ..cli.common import request\n", "offload_tuner.service.views")
    assert violations("from offload_tuner.cli import build_parser\n", "offload_tuner.app.tune")   # nobody imports it
    assert violations("from ..service.app import serve\n", "offload_tuner.cli.serve")           # CLI -> service
    assert violations("def f():\n    from ..service import app\n", "offload_tuner.cli.plan")   # another command
    assert violations("from ..service.app import serve\n", "offload_tuner.app.serve")           # at module level: no
    assert violations("def f():\n    from ..service.app import serve\n", "offload_tuner.app.plan")   # another use case
    assert violations("from offload_tuner import service\n", "planner", is_package=True)
    assert violations("def f():\n    from ..service.app import serve\n", "offload_tuner.app.serve")   # app: never
    assert not violations("def f():\n    from ..service.app import serve\n", "offload_tuner.cli.serve")   # the one way
    assert not violations("from ..app.requests import PlanRequest\n", "offload_tuner.service.bodies")
    assert not violations("from ..app.plan import plan_outcome\n", "offload_tuner.cli.plan")
    assert not violations("from .security import PathPolicy\n", "offload_tuner.service.app")    # within the service
    assert not violations("from . import tune\n", "offload_tuner.cli", is_package=True)


def test_runtime_never_imports_the_tuner_nor_the_application():
    """runtime/ depends on planner's core and the engine protocol only: the engines never reach up into the tuner,
    the CLI or the service (what they share with the tuner, EngineFit and the tables, lives below both)."""
    bad = [v for mod, (p, src) in product_sources().items() if names(mod, "runtime")
           for v in violations(src, mod, p.name == "__init__.py")]
    assert not bad, "\n".join(bad)


def argparse_outside_main(source: str) -> list[int]:
    """Lines importing argparse outside an `if __name__ == "__main__":` block (a module run as a script may parse
    its own argv there; the commands' flags are parsed in offload_tuner/cli)."""
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
    """runtime/ offers plain functions with typed arguments; the CLI parses the flags
    (offload_tuner/cli/runtime_cmds.py)."""
    bad = [f"{module_name(p)}:{line} imports argparse (parse the flags in offload_tuner/cli; runtime/ takes typed "
           "arguments)"
           for p in sorted((ROOT / "runtime").rglob("*.py")) for line in argparse_outside_main(p.read_text())]
    assert not bad, "\n".join(bad)
    assert argparse_outside_main("def f():\n    from argparse import Namespace\n") == [2]
    assert not argparse_outside_main('if __name__ == "__main__":\n    import argparse\n')


def test_the_runtime_check_catches_a_planted_import():
    assert violations("from tuner.baselines import EngineFit\n", "runtime.llamacpp")
    assert violations("def f():\n    from tuner.report import table\n", "runtime.run")
    assert violations("from offload_tuner import cli\n", "runtime.x")
    assert not violations("from planner.engine_contract import EngineFit\n", "runtime.llamacpp")
    assert not violations("from planner.tables import table\n", "runtime.run")


# ---- no circles, no private reads across modules, no probing of an engine (issue 42 items 2, 4, 9) -----------------

def import_graph(sources: Mapping[str, str], packages: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """{module: the product modules it imports}, every import at any depth (TYPE_CHECKING ones too: a type is an
    arrow a reader follows). A module's own packages are left out: Python runs a package's __init__ before any of
    its modules, so that arrow says nothing of the design."""
    return {mod: {n for n, _, _ in imports(src, mod, mod in packages)
                  if n in sources and n != mod and not mod.startswith(n + ".")}
            for mod, src in sources.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def defined_privates(source: str) -> set[str]:
    """The private names a module defines: functions, classes, module and class attributes, `self._x = ...`."""
    out = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return {x for x in out if _private(x)}


def private_reads(sources: Mapping[str, str], packages: frozenset[str] = frozenset()) -> list[str]:
    """Reads of another product module's private member: `x._name` outside `self`/`cls` where `_name` is defined
    only in other modules of the product, and `from product.module import _name`. Third-party privates (torch's,
    Optuna's, os._exit) are those libraries' business, not a seam of ours."""
    owners: dict[str, set[str]] = {}
    for mod, src in sources.items():
        for name in defined_privates(src):
            owners.setdefault(name, set()).add(mod)
    out = []
    for mod, src in sources.items():
        package = mod if mod in packages else mod.rpartition(".")[0]
        for n in ast.walk(ast.parse(src)):
            if (isinstance(n, ast.Attribute) and _private(n.attr) and isinstance(n.ctx, ast.Load)
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
                    and mod not in owners.get(n.attr, {mod})):
                out.append(f"{mod}:{n.lineno} reads {ast.unparse(n)[:60]} ({n.attr} is private to "
                           f"{', '.join(sorted(owners[n.attr]))})")
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - (n.level - 1)] + ([n.module] if n.module else []))
                if base in sources and base != mod:
                    out += [f"{mod}:{n.lineno} imports {a.name} from {base} (private to it)"
                            for a in n.names if _private(a.name)]
    return out


def engine_probes(source: str, module: str) -> list[str]:
    """getattr/hasattr on an engine, or inspect.signature: the engine protocol is declared (the hooks of
    planner.engine_contract.Engine), never probed."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if not isinstance(n, ast.Call):
            continue
        fn = ast.unparse(n.func)
        if (fn in ("getattr", "hasattr") and len(n.args) >= 2 and "engine" in ast.unparse(n.args[0]).lower()
                and isinstance(n.args[1], ast.Constant)):      # a named member, not a module's lazy lookup
            out.append(f"{module}:{n.lineno} {ast.unparse(n)[:60]} (declare it on planner.engine_contract.Engine)")
        elif fn == "inspect.signature":
            out.append(f"{module}:{n.lineno} {ast.unparse(n)[:60]} (a protocol method has one signature)")
    return out


def _packages(sources: Mapping[str, tuple[Path, str]]) -> frozenset[str]:
    return frozenset(m for m, (p, _) in sources.items() if p.name == "__init__.py")


def test_no_import_circle_in_the_product():
    sources = product_sources()
    found = circles(import_graph({m: s for m, (_, s) in sources.items()}, _packages(sources)))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_module_reads_another_modules_private_member():
    sources = product_sources()
    bad = private_reads({m: s for m, (_, s) in sources.items()}, _packages(sources))
    assert not bad, "\n".join(bad)


def test_no_engine_is_probed_for_its_protocol():
    bad = [v for mod, (_, src) in product_sources().items() for v in engine_probes(src, mod)]
    assert not bad, "\n".join(bad)


def test_the_seam_checks_catch_planted_cases():
    # a circle of two, and one of three through a function-level import; a package's own __init__ is no arrow
    two = {"tuner.a": "from . import b\n", "tuner.b": "from .a import x\n"}
    assert circles(import_graph(two)) == [["tuner.a", "tuner.b"]]
    three = {"tuner.a": "from .b import x\n", "tuner.b": "from .c import y\n",
             "tuner.c": "def f():\n    from .a import z\n", "tuner.d": "from .a import x\n"}
    assert circles(import_graph(three)) == [["tuner.a", "tuner.b", "tuner.c"]]
    assert not circles(import_graph({"tuner": "from .a import x\n", "tuner.a": "from tuner import y\n"},
                                    frozenset({"tuner"})))
    assert not circles(import_graph({"tuner.a": "from .b import x\n", "tuner.b": "import os\n"}))
    # private reads: another module's, imported or reached through an object; one's own and self's are fine
    mods = {"tuner.search": "class Tuner:\n    def _trial(self):\n        return self._x\n",
            "tuner.served": "def f(tuner):\n    return tuner._trial(1)\n",
            "tuner.seeds": "from .search import _helper\n",
            "tuner.pool": "def _own():\n    pass\nclass P:\n    def g(self, o):\n        return o._own, self._y\n",
            "tuner.x": "import os\ndef h():\n    os._exit(0)\n"}
    mods["tuner.search"] += "def _helper():\n    pass\n"
    bad = private_reads(mods)
    assert len(bad) == 2 and "tuner.served:2 reads tuner._trial" in bad[0] and "_helper from tuner.search" in bad[1]
    # engine probes
    assert engine_probes("x = getattr(tuner.engine, 'own_fit', None)\n", "tuner.baselines")
    assert engine_probes("if hasattr(engine, 'command'):\n    pass\n", "runtime.run")
    assert engine_probes("import inspect\nn = inspect.signature(f).parameters\n", "tuner.search")
    assert not engine_probes("x = engine.own_fit(inv, w, b)\ny = getattr(model, 'engine_name', None)\n", "m")
    assert not engine_probes("def __getattr__(name):\n    return getattr(engine, name)\n", "runtime.torch_engine")


def backslash_continuations(source: str) -> list[int]:
    """Lines that end in a backslash joining the next one, outside string literals (a C macro in a docstring, a
    regex, are strings): parentheses say where an expression goes on (issue 42 item 8)."""
    import io
    import tokenize
    inside: set[int] = set()            # lines a multi-line string spans (its last line ends the string)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)) and tok.end[0] > tok.start[0]:
            inside.update(range(tok.start[0], tok.end[0]))
    return [i for i, line in enumerate(source.splitlines(), 1) if line.endswith("\\") and i not in inside]


def test_no_backslash_continuation_in_the_product():
    bad = [f"{p.relative_to(ROOT)}:{i}" for root in FOLDERS for p in sorted((ROOT / root).rglob("*.py"))
           for i in backslash_continuations(p.read_text())]
    assert not bad, "a backslash continuation (use parentheses):\n" + "\n".join(bad)
    assert backslash_continuations("x = 1 + \\\n    2\n") == [1]
    assert backslash_continuations('x = (1 +\n     2)\ns = """a \\\nb"""\n') == []


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


def test_no_long_module_or_function_in_the_product():
    bad = [v for root in FOLDERS for p in sorted((ROOT / root).rglob("*.py"))
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
