"""Strategies: how the per-device program is laid over the local devices."""

from jaxlightning.strategies.base import Strategy as Strategy
from jaxlightning.strategies.mesh import FSDPStrategy as FSDPStrategy
from jaxlightning.strategies.mesh import ModelParallelStrategy as ModelParallelStrategy
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
