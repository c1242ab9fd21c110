"""Strategies: how the per-device program is laid over the local devices."""

from collections.abc import Sequence

import jax

from jaxlightning.strategies.base import Strategy as Strategy
from jaxlightning.strategies.mesh import FSDPStrategy as FSDPStrategy
from jaxlightning.strategies.mesh import ModelParallelStrategy as ModelParallelStrategy
from jaxlightning.strategies.mesh import fsdp_gathered as fsdp_gathered
from jaxlightning.strategies.pmap import PmapStrategy as PmapStrategy
from jaxlightning.strategies.shard_map import ShardMapStrategy as ShardMapStrategy

_BY_NAME = {
    "pmap": PmapStrategy,
    "shard_map": ShardMapStrategy,
    "auto": ShardMapStrategy,
    "fsdp": FSDPStrategy,
}


def resolve_strategy(strategy: str | Strategy) -> Strategy:
    """A `Strategy` from a name (``"auto"``, ``"pmap"``, ``"shard_map"``,
    ``"fsdp"``) or instance.

    ``"auto"`` is `ShardMapStrategy`: the faster of the two on the benchmarks.
    """
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return _BY_NAME[strategy]()
    except (KeyError, TypeError):
        raise ValueError(
            f"strategy={strategy!r} is not known; use one of {sorted(_BY_NAME)} or a "
            "Strategy instance"
        ) from None


# Lightning's accelerator names and the JAX platforms they mean.
_ACCELERATORS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}


def accelerator_devices(accelerator: str) -> list[jax.Device]:
    """The local devices of Lightning's ``accelerator`` (``"auto"``: JAX's default
    platform); a clear error when this machine has none of them."""
    if not isinstance(accelerator, str) or (
        accelerator != "auto" and accelerator not in _ACCELERATORS
    ):
        raise ValueError(
            f"accelerator={accelerator!r}: use 'auto', 'cpu', 'gpu' (or 'cuda') or 'tpu'"
        )
    if accelerator == "auto":
        return jax.local_devices()
    platform = _ACCELERATORS[accelerator]
    try:
        return jax.local_devices(backend=platform)
    except RuntimeError:
        present = sorted({d.platform for d in jax.local_devices()})
        raise RuntimeError(
            f"accelerator={accelerator!r}, but JAX finds no {platform} device here (it has "
            f"{', '.join(present)}). Install the JAX build for it (e.g. jax[cuda12] for GPUs) "
            "or use accelerator='auto'"
        ) from None


def resolve_devices(
    devices: int | str | Sequence[jax.Device], accelerator: str = "auto"
) -> list[jax.Device]:
    """The devices of ``Trainer(devices=..., accelerator=...)``: ``"auto"`` (every
    local device of the accelerator; in a multi-process run every device of the
    job), a count, or a list."""
    local = accelerator_devices(accelerator)
    if jax.process_count() > 1:
        if devices not in ("auto", len(local)):
            raise ValueError(
                f"devices={devices!r} in a {jax.process_count()}-process run: each process "
                f"uses all of its {len(local)} local devices; use devices='auto'"
            )
        return jax.devices()
    if devices == "auto":
        return local
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= len(local):
            raise ValueError(
                f"devices={devices} but this process has {len(local)} local "
                f"{local[0].platform} device(s). Use devices='auto' or a count up to "
                f"{len(local)}; on a CPU-only machine, simulate N devices by setting "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported"
            )
        return local[:devices]
    if isinstance(devices, Sequence) and all(isinstance(d, jax.Device) for d in devices):
        if not devices:
            raise ValueError("devices=[]: give at least one device, a count, or 'auto'")
        return list(devices)
    raise ValueError(f"devices={devices!r}: use 'auto', a count, or a list of jax devices")
