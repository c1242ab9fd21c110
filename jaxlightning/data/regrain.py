"""A grain ``DataLoader``'s saved position, carried to another number of processes.

grain's ``DataLoader`` (0.2.x) cuts one global order, its sampler's, into
shards by stride: with ``shard_count`` P, shard p reads the sampler's
positions p, p+P, p+2P, ...; with W worker processes, worker i of shard p
reads its shard's positions i, i+W, ... and makes whole batches of them, the
workers taking turns batch by batch. Its iterator state is that layout's
position: for each worker, the global position of the last record it handed
out (``last_seen_indices``), and which worker's batch comes next.

When every shard has handed out the same number of records m and each
shard's consumed records are a prefix of its share, the processes together
have consumed exactly the global positions ``[0, m*P)``. That prefix is the
position, on any layout: a run on P' processes goes on from global position
``g = m*P`` when its shards can stand there too — each at ``g / P'`` records
of its share, in whole batches of its own size, the prefix again. Where they
cannot (a position no layout of this size passes through), or where the
sampler's order itself depends on the process count (an ``IndexSampler``
given ``shard_options``: each process shuffles its own block), there is no
exact position to go on from, and the resume is refused with the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VERSION = 2  # grain's DataLoader state format this module reads and writes


@dataclass(frozen=True)
class Layout:
    """How a grain ``DataLoader`` on this run's process cuts the global order."""

    shard_index: int
    shard_count: int
    workers: int  # 0: batches made in this process
    batch_size: int | None  # records per batch (None: not batched by a Batch transform)
    drop_remainder: bool
    sampler: str  # the sampler's repr, which grain checks a restored state against
    records: int | None  # records of the sampler's order this shard reads (None: endless)


def layout(loader: Any) -> Layout:
    """``loader``'s layout (read from grain 0.2.x's ``DataLoader``; a ``TypeError``
    naming what is missing if its internals are not those)."""
    try:
        shard, sampler, operations = loader._shard_options, loader._sampler, loader._operations
        workers = int(loader.multiprocessing_options.num_workers)
    except AttributeError as exc:
        raise TypeError(
            f"cannot read how this grain DataLoader shards its data ({exc}); resuming it on "
            "another process count needs grain's DataLoader of grain 0.2.x"
        ) from exc
    import grain  # the loader is grain's

    one_to_one = (grain.transforms.Map, grain.transforms.MapWithIndex, grain.transforms.RandomMap)
    *before, last = operations or [None]
    size, drop = None, False  # a batch's records are unknown unless ...
    maps_only = all(isinstance(op, one_to_one) for op in before)
    if isinstance(last, grain.transforms.Batch) and maps_only:
        size, drop = int(last.batch_size), bool(last.drop_remainder)  # ... maps, then a Batch
    total = len(sampler)
    endless = total >= (1 << 62)  # grain's length of an endless sampler is sys.maxsize
    return Layout(
        shard_index=int(shard.shard_index),
        shard_count=int(shard.shard_count),
        workers=workers,
        batch_size=size,
        drop_remainder=drop,
        sampler=repr(sampler),
        records=None if endless else total // int(shard.shard_count),
    )


def _handed_out(state: dict[str, Any], shard: int, shards: int) -> list[int]:
    """Records each worker of ``shard`` (of ``shards``) has handed out, by grain's
    state: worker i's last record is at ``shard + i*shards + (n_i - 1)*W*shards``."""
    workers = max(int(state["worker_count"]), 1)
    stride = workers * shards
    last = state["last_seen_indices"]
    return [(int(last[str(i)]) - shard - i * shards + stride) // stride for i in range(workers)]


def _prefix_counts(records: int, workers: int) -> list[int]:
    """How many of a shard's first ``records`` records each of ``workers`` reads."""
    return [(records - i + workers - 1) // workers for i in range(workers)]


def consumed(states: Sequence[dict[str, Any]]) -> int:
    """The global records a run on ``len(states)`` processes consumed (the prefix
    ``[0, g)`` of the order), from its processes' grain ``DataLoader`` states."""
    shards = len(states)
    per_shard = []
    for p, state in enumerate(states):
        if state.get("version") != VERSION or "last_seen_indices" not in state:
            raise ValueError(
                f"process {p}'s saved data state is not a grain DataLoader state of format "
                f"version {VERSION} (it holds {sorted(state)}); only grain's DataLoader can "
                "be resumed on another process count"
            )
        last = [int(i) for i in state["last_seen_indices"].values()]
        if any((i - p) % shards for i in last):
            raise ValueError(
                f"process {p}'s saved data state is not that of shard {p} of {shards} (its "
                f"last records are at global positions {last}): the checkpoint's DataLoaders "
                "did not cut one order by process (DataLoader(shard_options=grain.sharding."
                "ShardByJaxProcess(...))), so no global position continues them. Resume on "
                f"{shards} process(es)"
            )
        counts = _handed_out(state, p, shards)
        if counts != _prefix_counts(sum(counts), len(counts)):
            raise ValueError(
                f"process {p}'s {len(counts)} data workers had handed out {counts} records: "
                "not the first records of its share, so no global position continues it. "
                f"Resume on {shards} process(es), or from a checkpoint taken after a "
                f"multiple of {len(counts)} batches"
            )
        per_shard.append(sum(counts))
    if len(set(per_shard)) > 1:
        raise ValueError(
            f"the processes had consumed {per_shard} records of their shards, unequal, so "
            f"no global position continues them; resume on {shards} process(es)"
        )
    return per_shard[0] * shards


def state_at(position: int, now: Layout, template: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """This process's grain ``DataLoader`` state at global ``position`` of the
    order on layout ``now``, and the batches each process has run by then.
    ``template`` is a saved state (its data source, checked by grain on restore)."""
    if template.get("sampler") != now.sampler:
        raise ValueError(
            "the checkpoint's grain sampler is not this run's: it was "
            f"{template.get('sampler')}, it is {now.sampler}. A sampler given "
            "shard_options shuffles each process's own block, so its order depends on "
            "the process count and has no position on another: give the IndexSampler no "
            "shard_options and the DataLoader shard_options=grain.sharding."
            "ShardByJaxProcess(drop_remainder=True) (one global order, cut by process)"
        )
    p, shards = now.shard_index, now.shard_count
    workers = max(now.workers, 1)
    at_end = now.records is not None and position >= now.records * shards
    if position % shards and not at_end:
        raise ValueError(
            f"the checkpoint was taken after {position} records of the global order, which "
            f"{shards} process(es) cannot split evenly; resume on a process count that "
            f"divides {position}"
        )
    mine = now.records if at_end else position // shards
    size = now.batch_size
    if size is None:
        raise ValueError(
            "this grain DataLoader's batches have no fixed number of records (it must end "
            "in one grain.transforms.Batch, after Map/MapWithIndex/RandomMap transforms "
            "only: a Filter drops records), so its position on another process count is "
            "unknown; resume on the same process count"
        )
    if at_end:
        batches = mine // size if now.drop_remainder else -(-mine // size)
        if now.workers:
            raise ValueError(
                "the checkpoint was taken at the end of its pass over the data, and this run's "
                "DataLoader has data workers, whose end position on another process count "
                "grain cannot be given; resume from the checkpoint taken at the epoch's end"
            )
        counts = [mine]
    else:
        if mine % size:
            raise ValueError(
                f"the checkpoint was taken after {position} records of the global order: "
                f"{mine} for each of this run's {shards} process(es), not a whole number of "
                f"batches of {size}. Choose a batch size that divides {mine}, or resume from "
                "a checkpoint taken at an epoch's end"
            )
        batches = mine // size
        counts = [size * -(-(batches - i) // workers) for i in range(workers)]
        if counts != _prefix_counts(mine, workers):
            raise ValueError(
                f"after {batches} batches, this run's {workers} data workers hold records "
                f"{counts} of each shard, not its first {mine}; resume at a multiple of "
                f"{workers} batches, or with another worker count"
            )
    stride = workers * shards
    state = {
        **template,
        "last_seen_indices": {
            str(i): p - stride + i * shards + n * stride for i, n in enumerate(counts)
        },
        "last_worker_index": batches % workers - 1 if now.workers else -1,
        "worker_count": now.workers,
        "sampler": now.sampler,
    }
    return state, batches
