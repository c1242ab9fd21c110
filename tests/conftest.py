"""Test set-up: 8 simulated CPU devices, set before jax is imported, one
persistent compilation cache for the session, and the two tiers.

``pytest`` runs the fast tier; ``pytest --full`` runs every test, the ones
marked ``@pytest.mark.slow`` too (multi-process jobs, object-storage servers,
fault injection, benchmark smoke runs, subprocess scripts, long sweeps).

Most of the suite's time is XLA compiling the same small programs again in
every test (each fit builds its own jitted steps); a cache shared by the
session, and by the processes its tests start (through the environment), makes
a repeated program a file read. Tests that count compiles (the ``compiles``
fixture) run with it off, so that every compile they count happens.
"""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
_CACHE = tempfile.mkdtemp(prefix="jaxlightning-tests-xla-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

from tests.helpers import CompileCounter  # noqa: E402

_COUNTER = CompileCounter()
jax.monitoring.register_event_duration_secs_listener(_COUNTER)
_SESSION_CACHE = jax.config.jax_compilation_cache_dir


def _use_cache(enabled: bool, path: str | None = _SESSION_CACHE) -> None:
    jax.config.update("jax_enable_compilation_cache", enabled)
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()  # JAX decides once whether a cache is in use


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", help="run the full suite: slow tests (marked slow) too"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: in the full suite only (pytest --full)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture
def compiles() -> CompileCounter:
    """Counts XLA backend compilations by function name from now on (with the
    persistent cache off: a program read from it would not be counted)."""
    _use_cache(False)
    _COUNTER.reset()
    yield _COUNTER
    _use_cache(True)


@pytest.fixture(autouse=True)
def _session_cache():
    """Puts the session's cache back after a test that chose another
    (``Trainer(compilation_cache_dir=...)`` sets it for the process)."""
    yield
    if jax.config.jax_compilation_cache_dir != _SESSION_CACHE:
        _use_cache(True)


@pytest.fixture(autouse=True, scope="session")
def _eight_devices() -> None:
    assert jax.local_device_count() == 8, "tests expect 8 simulated CPU devices"
    yield
    shutil.rmtree(_CACHE, ignore_errors=True)
