"""The package layout (issue 39): llamacli's packages stand in layers, lowest first, and a module imports only
from its own layer and the layers below; no two modules import each other, directly or round a cycle.

Every import counts, as `ast` finds it in the source: at the top of a module, inside a function, under
`if TYPE_CHECKING:` (a type-only import ties the layers together as much as any). Relative imports are
resolved; `from package import name` is an import of package.name where that is a module, else of the
package. Importing a module also runs its packages' __init__.py: theirs are in its own layer, and the root's
(llamacli/__init__.py, the top layer) imports only the foundation at its top (test_the_root_imports_little).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A layer is a list of modules and packages (a package: every module in it).
LAYERS: list[tuple[str, list[str]]] = [
    # What every layer may use: errors, sizes in words, where files are, threads, text in and out, progress
    # bars, the GPU driver's early start, the version, the entry's clock, the CPU threads' count and the
    # garbage collector's pauses.
    ("foundation", ["llamacli.errors", "llamacli.units", "llamacli.paths", "llamacli.background", "llamacli.textio",
                    "llamacli.progress", "llamacli.gpu_driver", "llamacli.version", "llamacli.startup",
                    "llamacli.cpu_threads", "llamacli.collector"]),
    ("ggufio", ["llamacli.ggufio"]),  # reading GGUF files
    ("tokenizer", ["llamacli.tokenizer"]),  # text <-> ids from the file's vocabulary
    ("chat", ["llamacli.chat"]),  # chat templates; reasoning apart from the answer
    ("models", ["llamacli.models"]),  # what a model is: config, per-layer plans, tensors, RoPE, routing, cache
    ("sampling", ["llamacli.sampling"]),  # logits -> the next id; constraints
    ("backends", ["llamacli.backends"]),  # NumPy and CUDA: the operations, the fused steps, device memory
    ("engine", ["llamacli.engine"]),  # generation, conversations, bench
    ("registry", ["llamacli.registry"]),  # model names -> files in the cache; downloads
    ("serve", ["llamacli.serve"]),  # the HTTP server
    ("cli", ["llamacli.cli"]),  # the commands
    ("testing", ["llamacli.testing"]),  # random models and real test data, for tests and benchmarks
    ("entry", ["llamacli", "llamacli.__main__"]),  # run() and load()
]

# Imports that cross the layers the wrong way for now, each with the change that removes it. A listed import
# that is gone fails the test too, so that its entry goes with it.
PENDING: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (or package)
    where: str  # file:line


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "llamacli").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(mods: dict[str, Path]) -> list[Import]:
    """Every import of a llamacli module by another, anywhere in its source."""
    found = []
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            else:
                continue
            for target in targets:
                if target != "llamacli" and not target.startswith("llamacli."):
                    continue
                while target not in mods and "." in target:  # `import llamacli.x.attr`-like: the module part
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    found.append(Import(name, target, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return found


def layer_of(module: str) -> int | None:
    best, index = -1, None
    for i, (_, members) in enumerate(LAYERS):
        for member in members:
            exact = member == "llamacli" or member.endswith("__main__")
            if module == member or (not exact and module.startswith(member + ".")):
                if len(member) > best:
                    best, index = len(member), i
    return index


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """(a cycle, its component) for each strongly connected component of more than one module (Tarjan): the
    shortest way from the component's first module back to itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:
        members = set(component)
        start = component[0]
        # the shortest way back to `start` inside the component (breadth first)
        paths = {start: [start]}
        queue = [start]
        cycle = None
        while queue and cycle is None:
            v = queue.pop(0)
            for w in sorted(graph[v] & members):
                if w == start:
                    cycle = paths[v] + [start]
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        found.append((cycle, component))
    return found


def counted(all_imports: list[Import]) -> list[Import]:
    return [i for i in all_imports if (i.source, i.target) not in PENDING]


def test_no_import_cycles() -> None:
    all_imports = counted(imports(modules()))
    graph: dict[str, set[str]] = {}
    for i in all_imports:
        graph.setdefault(i.source, set()).add(i.target)
        graph.setdefault(i.target, set())
    where = {(i.source, i.target): i.where for i in all_imports}
    report = []
    for cycle, component in cycles(graph):
        steps = [f"  {a} -> {b}  ({where[a, b]})" for a, b in zip(cycle, cycle[1:])]
        more = "" if len(component) == len(cycle) - 1 else f"\n  (one of the cycles among {component})"
        report.append("import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(steps) + more)
    assert not report, "\n".join(report)


def test_every_module_has_a_layer() -> None:
    homeless = [m for m in modules() if layer_of(m) is None]
    assert not homeless, f"modules in no layer (add them to LAYERS in {Path(__file__).name}): {homeless}"


def test_layers_import_only_downward() -> None:
    wrong = []
    for i in counted(imports(modules())):
        src, dst = layer_of(i.source), layer_of(i.target)
        if src is not None and dst is not None and dst > src:
            wrong.append(f"{i.source} ({LAYERS[src][0]}) imports {i.target} ({LAYERS[dst][0]}), a higher layer: "
                         f"{i.where}")
    assert not wrong, "\n".join(dict.fromkeys(wrong))


def test_pending_exceptions_still_exist() -> None:
    pairs = {(i.source, i.target) for i in imports(modules())}
    gone = [f"{a} -> {b}" for a, b in PENDING if (a, b) not in pairs]
    assert not gone, f"no longer imported, so drop them from PENDING: {gone}"


def test_the_root_imports_little() -> None:
    """Every `import llamacli.x` runs llamacli/__init__.py first: at its top it imports only the foundation
    (the CLI and the engine inside run() and load())."""
    path = ROOT / "llamacli" / "__init__.py"
    top = [n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    heavy = []
    for node in top:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [f"llamacli.{node.module}"] if node.module else [f"llamacli.{a.name}" for a in node.names]
            heavy += [f"{n} (line {node.lineno})" for n in names if layer_of(n) != 0]
        else:
            heavy.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not heavy, f"llamacli/__init__.py imports beyond the foundation at its top: {heavy}"


def test_tests_mirror_the_packages() -> None:
    """tests/<folder>/ holds the tests of llamacli/<folder>/ (tests/ itself: the top-level modules and the
    package as a whole)."""
    tests = Path(__file__).resolve().parent
    folders = {p.parent.relative_to(tests) for p in tests.rglob("test_*.py")} - {Path(".")}
    strays = sorted(str(f) for f in folders if not (ROOT / "llamacli" / f / "__init__.py").is_file())
    assert not strays, f"test folders without a llamacli package of the same name: {strays}"


def test_the_checks_see_what_they_look_for() -> None:
    """The cycle finder on a small graph, and the import reader on function-level, TYPE_CHECKING and relative
    imports (those the package holds: backends/base.py's inside a method, engine/generate.py's type-only one)."""
    found = cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}})
    assert found == [(["a", "b", "c", "a"], ["a", "b", "c"])]
    pairs = {(i.source, i.target) for i in imports(modules())}
    assert ("llamacli.backends.base", "llamacli.sampling.structured") in pairs  # inside sample_allowed
    assert ("llamacli.engine.generate", "llamacli.sampling.structured") in pairs  # TYPE_CHECKING and inside run
    assert ("llamacli.backends.numpy_backend", "llamacli.models.rope") in pairs  # from ..models import rope


# -- tests use public names only (issue 39) ---------------------------------------------------------------------
#
# A test that reaches a private name (one with a leading underscore: _helper, module._state, obj._method) checks
# how the code is written rather than what it promises: it breaks on a rename that changes no behaviour, and holds
# the helper in place. So tests go through public names: the behaviour a helper serves, or the helper made public
# (with a docstring, a contract of its own) where it is a unit worth testing alone. Read with `ast` from every file
# under tests/ but tests/backends/cuda/ (the CUDA backend's tests, reshaped with the backend), wherever in the file:
# - an import of a private name or from a private module of llamacli: `from llamacli.x import _y`, `import
#   llamacli._x`;
# - a private attribute of anything but the test's own objects (self, cls, super()): `module._name`,
#   `obj._method`. Which object is llamacli's cannot be told from the source, so the few private attributes of
#   other libraries' objects that tests need are listed in FOREIGN_PRIVATE, each with why;
# - a private name handed as a string to what reaches attributes by name: monkeypatch.setattr(obj, "_x", ...),
#   delattr, getattr, hasattr, mock.patch.object; likewise checked against FOREIGN_PRIVATE;
# - a dotted llamacli path with a private part as a string handed to a call: monkeypatch.setattr("llamacli.x._y",
#   ...), mock.patch("llamacli.x._y"), importlib.import_module("llamacli._x").
# Dunder names (__version__, __file__, __name__) are not private.

# (test file, the private attribute as `object.name`) -> why a test may touch it. A listed use that is gone fails
# the check too, so that its entry goes with it.
FOREIGN_PRIVATE: dict[tuple[str, str], str] = {
    ("tests/models/test_moe.py", "GptOssExperts._apply_gate"):
        "transformers' own gpt-oss gate (clamped SwiGLU): the reference the NumPy backend is compared with",
    ("tests/cli/test_keep_alive.py", "os._exit"):
        "the standard library's os._exit (documented, underscore and all): a forked child that plays another "
        "user must leave without the test process's atexit handlers and pytest's teardown",
    ("tests/backends/test_backend_select.py", "os._exit"):
        "the standard library's os._exit (documented, underscore and all), replaced so that a test sees the "
        "CLI's entry leave through it",
    ("tests/test_readme.py", "ctx._protected_args"):
        "click's parsed command words (click 8.2 keeps them only there), to resolve a README command's subcommand",
}

_BY_NAME = {"setattr", "delattr", "getattr", "hasattr", "object"}  # calls whose 2nd argument names an attribute


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _own(node: ast.expr) -> bool:
    """Whether an attribute chain starts at the test's own object: self, cls or super()."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id in ("self", "cls", "super")


def private_uses(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, what) for each use of a private name in a test's source, as the comment above describes;
    kind "attribute" (what: `object.name`, as FOREIGN_PRIVATE keys it) or "import" / "string" (what: the name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, "import", a.name) for a in node.names
                      if a.name.split(".")[0] == "llamacli" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "llamacli":
            if any(map(_private, node.module.split("."))):
                found.append((node.lineno, "import", node.module))
            found += [(node.lineno, "import", f"{node.module}.{a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            found.append((node.lineno, "attribute", f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            named = node.args[1] if len(node.args) >= 2 else None
            if (name in _BY_NAME and isinstance(named, ast.Constant) and isinstance(named.value, str)
                    and _private(named.value) and not _own(node.args[0])):
                found.append((node.lineno, "attribute", f"{ast.unparse(node.args[0])}.{named.value}"))
            for arg in node.args:
                path = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
                parts = path.split(".")
                if parts[0] == "llamacli" and all(p.isidentifier() for p in parts) and any(map(_private, parts)):
                    found.append((node.lineno, "string", path))
    return sorted(found)


def checked_test_files() -> list[Path]:
    tests = Path(__file__).resolve().parent
    return sorted(tests.rglob("*.py"))


def test_tests_use_public_names_only() -> None:
    wrong, foreign_seen = [], set()
    for path in checked_test_files():
        rel = str(path.relative_to(ROOT))
        for line, kind, what in private_uses(path.read_text(encoding="utf-8")):
            if kind == "attribute" and (rel, what) in FOREIGN_PRIVATE:
                foreign_seen.add((rel, what))
                continue
            wrong.append(f"{rel}:{line}: {kind} {what}")
    assert not wrong, ("tests reach private names: test through the public behaviour, or make the helper public "
                       "(a docstring, no underscore); another library's private attribute goes in FOREIGN_PRIVATE "
                       "with why (tests/test_layering.py):\n" + "\n".join(wrong))
    gone = sorted(set(FOREIGN_PRIVATE) - foreign_seen)
    assert not gone, f"no longer used, so drop them from FOREIGN_PRIVATE: {gone}"


def test_the_private_name_check_sees_what_it_looks_for() -> None:
    source = '''
import llamacli._hidden
from llamacli.engine.generate import Model, _split_stop, __version__
from llamacli._private import thing
from llamacli import startup, gpu_driver as _driver_module

def test(monkeypatch, model):
    from llamacli.serve.api import _effort
    monkeypatch.setattr(gpu_driver, "_thread", [])
    monkeypatch.setattr("llamacli.registry.registry._have_hf_token", lambda: False)
    monkeypatch.setattr(gpu_driver, "PROCESS", None)
    getattr(model, "_chat")
    model.backend._ahead += 1
    startup._started.clear()
    x = self._mine + cls._ours + super()._theirs + model.__class__ + model.public
'''
    assert private_uses(source) == [
        (2, "import", "llamacli._hidden"),
        (3, "import", "llamacli.engine.generate._split_stop"),
        (4, "import", "llamacli._private"),
        (8, "import", "llamacli.serve.api._effort"),
        (9, "attribute", "gpu_driver._thread"),
        (10, "string", "llamacli.registry.registry._have_hf_token"),
        (12, "attribute", "model._chat"),
        (13, "attribute", "model.backend._ahead"),
        (14, "attribute", "startup._started"),
    ]
