"""The documentation builds with mkdocs in strict mode (no broken links or nav)."""

import re
import subprocess
import sys
import types
from pathlib import Path

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
    assert namespace["trainer"].callback_metrics["val/acc"] > 0.5
    exec(compile(index, "docs/index.md", "exec"), namespace)
    assert "test/acc" in namespace["trainer"].callback_metrics
