"""The package's layering, read from every import statement (those inside functions too).

Each layer may import only the layers below it; the engine never imports the report or the CLI,
nor typer or rich; nothing under memcalc/ imports torch (verify/ does, lazily, for `memcalc verify`).
Inside memcalc.exact the rooms are layered the same way, and no module imports one that imports it
back, at any depth (an import under `if TYPE_CHECKING:` is for annotations only and not counted).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "memcalc"

# Lowest first. A module may import its own layer and those listed before it.
LAYERS = [
    {"memcalc.records"},  # the dataclass decorator every layer uses
    {"memcalc.errors", "memcalc.terms"},
    {"memcalc.model"},
    {"memcalc.exact"},
    {"memcalc.memory"},
    {"memcalc.time"},
    {"memcalc.parallel"},
    {"memcalc.serve"},  # serving: weights, KV cache, vLLM's budget, decode time
    {"memcalc.engine"},
    {"memcalc.verification"},
    {"memcalc.report"},
    {"memcalc.web"},  # the local page's server: runs the commands the CLI hands it
    {"memcalc.cli"},
]
# memcalc.exact's rooms, lowest first (memcalc/exact/__init__.py); its entry points (kernels, step, growth,
# timeline) sit on top of them all.
EXACT_ROOMS = ["base", "allocator", "sim", "aten", "builder", "hf", "torchtune", "train", "replay"]
NEVER = {"torch", "transformers", "flash_attn", "numpy"}  # heavy: verify/ alone imports them
ONLY_IN = {  # third-party or harness packages, and the one layer that may import each (lazily)
    "typer": "memcalc.cli", "click": "memcalc.cli", "rich": "memcalc.cli", "verify": "memcalc.cli",
    "matplotlib": "memcalc.report",  # --png, an optional extra
}


def unit_of(module: str) -> str:
    """'memcalc.model.shape' -> 'memcalc.model'; 'memcalc.errors' -> itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def in_a_layer(unit: str) -> bool:
    return any(unit in layer for layer in LAYERS)


def rank(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(name: str, source: str | ast.Module, is_package: bool = False) -> list[str]:
    """Every module an import statement in the module `name` names, relative imports resolved."""
    package = name if is_package else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out.append(module)
            out += [f"{module}.{a.name}" for a in node.names]  # from memcalc.report import render
    return out


def room_rank(module: str) -> int | None:
    """The rank of a module of memcalc.exact by its room (the entry points above every room); None outside."""
    parts = module.split(".")
    if parts[:2] != ["memcalc", "exact"] or len(parts) < 3:
        return None
    return EXACT_ROOMS.index(parts[2]) if parts[2] in EXACT_ROOMS else len(EXACT_ROOMS)


def violations(name: str, source: str, is_package: bool = False) -> list[str]:
    """What the module `name` imports against the layering."""
    unit, found = unit_of(name), []
    for imported in imports(name, source, is_package):
        low, high = room_rank(imported), room_rank(name)
        if low is not None and high is not None and low > high:
            found.append(f"{name} (room {high}) imports {imported} (room {low})")
        top = imported.split(".")[0]
        if top in NEVER:
            found.append(f"{name} imports {top}")
        if top in ONLY_IN and ONLY_IN[top] != unit:
            found.append(f"{name} imports {top}, which only {ONLY_IN[top]} may")
        target = unit_of(imported)
        if top != "memcalc" or imported == "memcalc" or target == unit or not in_a_layer(target):
            continue  # not memcalc, its own layer, or a name of the top package (memcalc.__version__)
        if rank(target) >= rank(unit):
            found.append(f"{name} (layer {rank(unit)}) imports {target} (layer {rank(target)})")
    return list(dict.fromkeys(found))


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def test_every_module_sits_in_a_layer():
    for path in MODULES:
        name = module_name(path)
        if name != "memcalc":
            assert in_a_layer(unit_of(name)), f"{name} is in no layer"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path):
    name = module_name(path)
    if name == "memcalc":  # the public API: imports lazily from every layer
        return
    assert violations(name, path.read_text(), path.name == "__init__.py") == []


def test_every_package_says_what_it_holds_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(ROOT)}: say what it may import"


def test_the_checker_finds_each_kind_of_violation():
    source = "import torch\nfrom rich.table import Table\n\ndef f():\n    from ..report import render\n"
    found = violations("memcalc.model.probe", source)
    assert len(found) == 3, found
    assert violations("memcalc.exact.probe", "from memcalc.memory.estimate import Setup\n")  # exact is below memory
    assert violations("memcalc.report.probe", "from ..cli import views\n")
    assert not violations("memcalc.time.probe", "from ..exact import sim\nfrom .roofline import step_time\n")
    assert violations("memcalc.exact.sim.probe", "from ..aten import mm\n")  # the simulator core is below the ops
    assert violations("memcalc.exact.builder.probe", "from ..replay.meta import simulate\n")
    assert not violations("memcalc.exact.hf.probe", "from ..builder.layers import core\nfrom .family import Family\n")


def runtime_imports(path: Path) -> set[str]:
    """The modules of memcalc that the module at `path` imports when it runs: at its top or inside a function,
    not under `if TYPE_CHECKING:` (for annotations only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = [ast.Pass()]
    named = imports(module_name(path), tree, path.name == "__init__.py")
    return {m for m in named if m in MODULE_NAMES} - {module_name(path)}


MODULE_NAMES = {module_name(p) for p in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: its strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_inside_exact():
    exact = {module_name(p): runtime_imports(p) for p in MODULES if module_name(p).startswith("memcalc.exact")}
    assert circles(exact) == []


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_room_of_exact_is_layered():
    rooms = {p.parent.name for p in (PACKAGE / "exact").glob("*/__init__.py")}
    assert rooms == set(EXACT_ROOMS)
    for room in rooms:
        doc = ast.get_docstring(ast.parse((PACKAGE / "exact" / room / "__init__.py").read_text())) or ""
        assert "May import" in doc, f"memcalc/exact/{room}/__init__.py: say what it may import"


def test_each_class_name_means_one_thing():
    """No two modules of memcalc define a class of the same name (Memory, Model, Config and StepTime each once
    named two things: the live bytes and the textbook's memory, the replayed model and the user's)."""
    defined: dict[str, list[str]] = {}
    for path in MODULES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(module_name(path))
    assert {name: where for name, where in defined.items() if len(where) > 1} == {}
