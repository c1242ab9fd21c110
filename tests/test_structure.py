"""The package's shape: components, not mixins; imports that flow one way."""

import ast
import pathlib

import pytest

import jaxlightning as jl

PACKAGE = pathlib.Path(jl.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(
    tree: ast.Module, name: str, is_package: bool, modules: set[str] = frozenset()
) -> set[str]:
    """Modules of the package ``name`` imports when it runs, at import time or
    lazily inside a function (not under TYPE_CHECKING)."""
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
                    named = {f"{base}.{a.name}" for a in child.names}
                    found.update(named)
                    # ``from package import submodule`` runs the package's
                    # __init__, but reaches for the submodule, not its re-exports
                    if not named <= modules:
                        found.add(base)
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        imports = _runtime_imports(tree, name, path.name == "__init__.py", set(modules))
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
    "xla/cost.py": {"jax._src.lib", "jax._src.lib._jax", "jaxlib", "jaxlib._hlo"},
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


# --------------------------------------------------------------- sizes, contract
def _classes(folder: pathlib.Path) -> list[tuple[str, int]]:
    found = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.append((f"{path.name}:{node.name}", node.end_lineno - node.lineno + 1))
    return found


def _functions() -> list[tuple[str, int]]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
                found.append((where, node.end_lineno - node.lineno + 1))
    return found


def test_functions_are_short_enough_to_read():
    # A cap on functions, not on files or classes: a file that grows by a
    # feature is fine where each function stays readable (docstring included).
    assert [(where, n) for where, n in _functions() if n > 80] == []


def test_no_folder_is_a_storeroom():
    # A folder holds one concern; one that passes 15 modules holds several.
    for folder in [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        modules = list(folder.glob("*.py"))
        assert len(modules) <= 15, (folder.name, len(modules))
        init = folder / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), (
            f"{folder.name}/__init__.py should say what the folder holds"
        )


# Private names of other objects a module may read: NamedTuple's own API, and
# grain 0.2.x's DataLoader internals (no public accessor; guarded by a
# TypeError that says so, tested in tests/test_regrain.py).
ALLOWED_PRIVATE = {"_replace", "_fields", "_asdict", "_make"}
THIRD_PARTY_PRIVATE = {"data/regrain.py": {"_shard_options", "_sampler", "_operations"}}
CONTRACT = {"module.py", "training/contract.py"}  # where JaxModule's internals are read


def _private_reads(path: pathlib.Path) -> list[tuple[str, str]]:
    """``x._name`` in ``path`` where ``x`` is not self/cls and ``_name`` is not
    one this module defines itself (a private name reached across modules)."""
    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
    reads = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in own:
            continue
        # ``cls._x`` reads a private name of whatever class ``cls`` is (a
        # JaxModule subclass in a check): only ``self``'s own are exempt
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue
        reads.append((name, f"{ast.unparse(node)} (line {node.lineno})"))
    return reads


def test_private_names_are_not_reached_across_modules():
    # The framework's calls into JaxModule internals go through
    # training/contract.py; nothing else reads another object's private names.
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in CONTRACT:
            continue
        allowed = ALLOWED_PRIVATE | THIRD_PARTY_PRIVATE.get(rel, set())
        reads = [where for name, where in _private_reads(path) if name not in allowed]
        if reads:
            found[rel] = reads
    assert found == {}
    assert sum(map(len, THIRD_PARTY_PRIVATE.values())) <= 5


def test_the_trainer_takes_exactly_its_trainer_args():
    # One record of the arguments: the Trainer's keyword signature (what IDEs
    # and the CLI read) and TrainerArgs' fields agree name by name, default by
    # default; the docstring documents each.
    import dataclasses
    import inspect

    params = list(inspect.signature(jl.Trainer.__init__).parameters.values())[1:]
    fields = dataclasses.fields(jl.TrainerArgs)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [f.default for f in fields]
    assert all(p.kind is p.KEYWORD_ONLY for p in params)
    doc = inspect.getdoc(jl.Trainer)
    assert [f.name for f in fields if f"\n    {f.name}: " not in doc] == []
    trainer = jl.Trainer(max_epochs=3, logger=False, enable_progress_bar=False)
    assert trainer.args.max_epochs == 3 and trainer.args.precision == "32-true"
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.args.max_epochs = 4


# ------------------------------------------------------------------ layers
# The package from the bottom up: a module imports only from its own layer or
# below. Names are top-level modules and folders of the package.
LAYERS = [
    {"cluster", "seed", "progress", "schedule", "metrics", "adapters"},
    {"xla", "io"},
    {"module"},
    {"training"},
    {"strategies"},
    {"data", "loggers"},
    {"programs", "reporting", "checks"},
    {"callbacks"},
    {"loop"},
    {"trainer"},
    {"tuner"},
    {"cli", "launch", "__init__"},
]
# Imports that point up a layer, each named with its reason (at most one).
POINTING_UP: dict[tuple[str, str], str] = {}
# Imports made inside a function instead of at the top, each named with its reason.
LAZY: dict[tuple[str, str], str] = {}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit in units)


def test_every_part_of_the_package_has_a_layer():
    units = {_unit(m) for m in _graph()}
    assert sorted(u for u in units if not any(u in layer for layer in LAYERS)) == []


def test_imports_point_down():
    up = sorted(
        (name, dep)
        for name, deps in _graph().items()
        for dep in deps
        if _layer(_unit(dep)) > _layer(_unit(name))
    )
    assert [edge for edge in up if edge not in POINTING_UP] == []
    assert len(POINTING_UP) <= 1


def _lazy_imports() -> list[tuple[str, str]]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "jaxlightning"
                ):
                    found.append((name, node.module))
                elif isinstance(node, ast.Import):
                    found += [
                        (name, a.name) for a in node.names if a.name.startswith("jaxlightning")
                    ]
    return sorted(set(found))


def test_lazy_imports_are_named():
    # An import inside a function hides a dependency from a reader of the
    # file's head; each one left is named with its reason.
    assert [edge for edge in _lazy_imports() if edge not in LAZY] == []


def _imports_of(prefix: str) -> list[tuple[str, str]]:
    return [
        (name, dep)
        for name, deps in _graph().items()
        if name == prefix or name.startswith(prefix + ".")
        for dep in deps
    ]


# The loop knows the Callback interface (callbacks.base) only; two modules are
# the exceptions: wiring builds the default callbacks, and hooks serves
# Lightning's checkpoint_callback / progress_bar_callback properties and runs
# the monitoring callbacks last at an epoch's end.
LOOP_KNOWS_CALLBACKS = {"jaxlightning.loop.wiring", "jaxlightning.loop.hooks"}


def test_the_loop_imports_no_concrete_callback():
    concrete = [
        (name, dep)
        for name, dep in _imports_of("jaxlightning.loop")
        if dep.startswith("jaxlightning.callbacks")
        and dep != "jaxlightning.callbacks.base"
        and name not in LOOP_KNOWS_CALLBACKS
    ]
    assert concrete == []


def test_argument_checks_import_no_callback():
    assert [d for _, d in _imports_of("jaxlightning.checks") if "callbacks" in d] == []


def test_only_the_public_face_and_the_cli_import_the_tuner():
    importers = {
        name
        for name, deps in _graph().items()
        if any(d.startswith("jaxlightning.tuner") for d in deps)
        and not name.startswith("jaxlightning.tuner")
    }
    assert importers <= {"jaxlightning", "jaxlightning.cli"}


def test_steps_per_execution_has_few_homes():
    # The group rule lives with the data side; the argument is declared,
    # checked and run in a handful of places, not threaded through the package.
    homes = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "steps_per_execution" in p.read_text()
    ]
    assert len(homes) <= 5, homes
