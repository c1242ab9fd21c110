"""The documentation builds with mkdocs in strict mode (no broken links or nav)."""

import ast
import importlib.metadata
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "quickstart" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # the reference is generated from the docstrings
    assert "log_every_n_steps" in api and "Optimizers" in api and "reduce_fx" in api


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_example_runs_and_index_example_uses_only_defined_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its logs and checkpoints go here
    (readme,) = _python_blocks(ROOT / "README.md")
    (index,) = _python_blocks(ROOT / "docs" / "index.md")
    # The README's example is the one readers copy: run it as written, but short.
    readme = readme.replace("max_epochs=10", "max_epochs=2")
    index = index.replace("max_epochs=10", "max_epochs=1")
    namespace = {"__name__": "readme_example"}
    sys.modules["readme_example"] = types.ModuleType("readme_example")  # flax dataclasses
    exec(compile(readme, "README.md", "exec"), namespace)
    metrics = namespace["trainer"].callback_metrics
    assert metrics["acc"] > 0.5  # validate's value, the name as logged
    exec(compile(index, "docs/index.md", "exec"), namespace)
    assert "acc" in namespace["trainer"].callback_metrics


def test_every_third_party_import_of_the_package_is_a_declared_dependency():
    # orbax-checkpoint was once imported but not declared.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [reqs for name, reqs in project["optional-dependencies"].items() if name != "dev"]
    declared = set()
    for requirement in project["dependencies"] + [r for reqs in extras for r in reqs]:
        declared.add(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower())
    providers = importlib.metadata.packages_distributions()
    imported = set()
    for path in (ROOT / "jaxlightning").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names | {"jaxlightning"}}
    missing = {  # an optional extra not installed here cannot be looked up: CI installs them
        m: providers[m]
        for m in third_party
        if m in providers and not {d.lower() for d in providers[m]} & declared
    }
    assert "orbax" in third_party and not missing, missing


GUIDES = sorted(  # index.md runs with the README above
    p.name
    for p in (ROOT / "docs").glob("*.md")
    if p.name != "index.md" and "```python" in p.read_text()
)
NOT_RUN = re.compile(r"<!-- not run: [^>]+ -->\s*$")


def _runnable_blocks(path: Path) -> list[str]:
    """The page's Python blocks in order, except those marked right above with
    ``<!-- not run: reason -->`` (code of another library, shown for comparison)."""
    text = path.read_text()
    blocks = []
    for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not NOT_RUN.match(before):
            blocks.append(match.group(1))
    return blocks


def _shorter(code: str) -> str:
    """The same code with short runs: every ``max_epochs=N`` argument becomes 2."""
    return re.sub(r"(?<![.\w])max_epochs=\d+", "max_epochs=2", code)


@pytest.fixture(scope="module")
def guide_prelude():
    """Names the guides' fragments assume (they say so where they are used):
    the digits example's module and loaders, a datamodule, a weights array."""
    from tests.helpers import load_example

    digits = load_example("digits")
    train_loader, val_loader = digits.digits_loaders(128)
    return {
        "LitDigits": digits.LitDigits,
        "model": digits.LitDigits(),
        "train_loader": train_loader,
        "val_loader": val_loader,
        "test_loader": val_loader,
        "loader": val_loader,
        "DigitsData": digits.DigitsData,
        "weights": digits.np.ones((3, 3), digits.np.float32),
    }


@pytest.mark.parametrize("page", GUIDES)
def test_every_python_block_of_the_guides_runs(page, guide_prelude, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # logs, checkpoints and run files go here
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # as from a checkout's root
    blocks = _runnable_blocks(ROOT / "docs" / page)
    assert blocks, f"{page}: every Python block is marked not run"
    name = f"guide_{page[:-3].replace('-', '_')}"
    sys.modules[name] = types.ModuleType(name)  # flax modules are dataclasses: they need it
    namespace = {"__name__": name, **guide_prelude}
    prelude = "import jax, optax, numpy as np, flax.linen as nn, jaxlightning as jl"
    exec(compile(prelude, f"{page} (prelude)", "exec"), namespace)
    for i, block in enumerate(blocks):
        exec(compile(_shorter(block), f"docs/{page}, block {i + 1}", "exec"), namespace)
