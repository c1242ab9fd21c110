"""The package's shape: components, not mixins; imports that flow one way."""

import ast
import pathlib

import jaxlightning as jl

PACKAGE = pathlib.Path(jl.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Modules of the package imported when ``name`` runs (not under TYPE_CHECKING)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("jaxlightning"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = name.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join([*anchor, base]) if base else ".".join(anchor)
                if base.startswith("jaxlightning"):
                    found.add(base)
                    found.update(f"{base}.{a.name}" for a in child.names)
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        imports = _runtime_imports(tree, name, path.name == "__init__.py")
        graph[name] = {m for m in imports if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_no_import_cycle_between_modules_of_the_package():
    # A package's __init__ re-exporting its submodules is not a cycle of its own:
    # count a submodule -> its package edge only when it reaches past the re-exports.
    graph = _graph()
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_trainer_is_composed_not_mixed_in():
    assert jl.Trainer.__bases__ == (object,)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith("Mixin"), f"{path.name}: class {node.name}"


def test_callbacks_do_not_import_the_trainer():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("jaxlightning.callbacks"):
            assert not {
                d for d in deps if d.startswith(("jaxlightning.trainer", "jaxlightning.loop"))
            }, name


def _imports_into(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    graph = _graph()
    prefix = f"jaxlightning.{folder}"
    return [
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if name == prefix or name.startswith(prefix + ".")
        for dep in deps
        if dep.startswith(tuple(f"jaxlightning.{f}" for f in forbidden))
    ]


def test_what_runs_in_the_step_imports_no_loop_data_callback_or_trainer():
    outward = ("loop", "data", "callbacks", "trainer", "loggers", "io", "tuner", "cli")
    assert _imports_into("training", outward) == []
    assert _imports_into("metrics", (*outward, "training")) == []


def test_the_fit_loop_imports_no_callback_and_names_no_feature():
    # Features subscribe to the state points (loop/state_points.py): the fit
    # loop neither imports a callback nor branches on rollback.
    assert _imports_into("loop.fit_loop", ("callbacks",)) == []
    tree = ast.parse((PACKAGE / "loop" / "fit_loop.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {"guard", "ModelCheckpoint", "RollbackGuard", "of_type"} & names


def test_storage_and_cluster_code_import_neither_the_loop_nor_the_trainer():
    assert _imports_into("io", ("loop", "trainer", "tuner", "cli")) == []
    assert _imports_into("cluster", ("loop", "trainer", "tuner", "cli", "io", "data")) == []


def test_the_top_level_holds_only_the_public_faces():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(modules) <= 14, modules


# The one exemption, each import guarded (a jax that moves it changes a figure
# to a stated lower bound, never breaks a fit; the fallback is tested in
# tests/test_step_cost.py): XLA's HLO parser and per-module cost analysis,
# which no public JAX API offers, for the FLOPs of loop bodies.
GUARDED_PRIVATE = {
    "tuner/cost.py": {"jax._src.lib", "jax._src.lib._jax", "jaxlib", "jaxlib._hlo"},
}


def test_only_public_jax_apis_are_used():
    # jax._src and private attributes move between releases (the project
    # supports several): the package reaches JAX through its public modules only.
    for path in PACKAGE.rglob("*.py"):
        allowed = GUARDED_PRIVATE.get(path.relative_to(PACKAGE).as_posix(), set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[0] in ("jax", "jaxlib") and name not in allowed:
                    assert not any(p.startswith("_") for p in name.split(".")), (
                        f"{path.relative_to(PACKAGE)} imports {name}"
                    )
