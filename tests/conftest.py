"""Test set-up: 8 simulated CPU devices, set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import CompileCounter  # noqa: E402

_COUNTER = CompileCounter()
jax.monitoring.register_event_duration_secs_listener(_COUNTER)


@pytest.fixture
def compiles() -> CompileCounter:
    """Counts XLA backend compilations by function name from now on."""
    _COUNTER.reset()
    return _COUNTER


@pytest.fixture(autouse=True, scope="session")
def _eight_devices() -> None:
    assert jax.local_device_count() == 8, "tests expect 8 simulated CPU devices"
