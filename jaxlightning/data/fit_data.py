"""A fit's training data: the loader, its count per epoch, where a resumed fit
starts in it, and each epoch's batches handed out in groups.

`FitData` is built once per fit. The count of batches per epoch is computed
here once; it owns where the fit starts (a checkpoint's position carried into
this run's batches: another process count or batch size, a grain loader's
iterator state re-laid out by `regrain`), opens the first epoch ahead (its
first batch gives the shapes to compile for), and hands the fit loop each
epoch's batches with the batch they start at, to iterate in the groups it
dispatches, cut where its ``ends`` rule says the host needs the state.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax

from jaxlightning.cluster import distributed
from jaxlightning.data import regrain
from jaxlightning.data.convert import dataset_length, loader_batch_size
from jaxlightning.data.pipeline import Pipeline
from jaxlightning.data.prefetch import Batches, DeviceBatch
from jaxlightning.data.resident import ResidentDataset
from jaxlightning.data.stateful import decode, encode, grain_data_loader, iterates_statefully

_UNCHOSEN = object()
Group = list[tuple[int, Any]]  # (batch index in the epoch, device batch), in order


class FitData:
    """The training data of one fit.

    Args:
        pipeline: makes the device batches (and keeps a grain loader's state
            to resume from).
        loader: the training loader (or any iterable of batches).
    """

    def __init__(self, pipeline: Pipeline, loader: Any) -> None:
        self.pipeline = pipeline
        self.loader = loader
        self.per_epoch: int | None = pipeline.train_batches_per_epoch(loader)
        self.skip = 0  # the batch of its first epoch the fit starts at
        self._state: dict | None = None  # a stateful loader's iterator state there
        self._opened: tuple[int, Batches] | None = None  # the first epoch, opened ahead
        self._resident: Any = _UNCHOSEN  # where the batches come from (`choose_path`)

    def choose_path(self) -> ResidentDataset | None:
        """Decides where this fit's batches come from, once (at its first
        batch; again after the pipeline is sent to the host, when the dataset's
        copy does not fit beside the step): the dataset kept on the devices, or
        ``None``, the host."""
        self._resident = self.pipeline.train_path(self.loader)
        return self._resident

    def _path(self) -> ResidentDataset | None:
        if self._resident is _UNCHOSEN:
            return self.choose_path()
        return self._resident

    @property
    def trains(self) -> bool:
        """Whether an epoch has any batch (``limit_train_batches=0``: none)."""
        return self.per_epoch != 0

    def batching(self) -> dict[str, int] | None:
        """How this run cuts its batches, as its checkpoints record it."""
        return batching(jax.process_count(), loader_batch_size(self.loader))

    def resume_at(self, meta: Mapping[str, Any]) -> tuple[int, dict | None]:
        """The batch of its epoch a checkpoint's record resumes at, in this
        run's batches, and (a grain loader's) this process's iterator state to
        go on from, which the epoch's first pass then uses."""
        processes = jax.process_count()
        skip = rebatched(
            meta,
            meta["progress"]["batch"],
            processes=processes,
            batch_size=loader_batch_size(self.loader),
            num_examples=dataset_length(self.loader),
        )
        state = None
        if iterates_statefully(self.loader):
            state, skip = data_state(meta, self.loader, skip, processes, jax.process_index())
        self.skip, self._state = skip, state
        return skip, state

    def open(self, epoch: int) -> Batches:
        """Opens the fit's first epoch, ``epoch``, from its start batch (the
        first batch ready on return): `epoch` hands it to the loop. Close it
        if the fit ends before."""
        batches = self.pipeline.train_epoch(
            self.loader, epoch, self.skip, self._path(), self._state
        )
        self._opened = (epoch, batches)
        return self._opened[1]

    def epoch(self, epoch: int) -> tuple[Batches, int]:
        """Epoch ``epoch``'s batches and the batch of the epoch they start at:
        the fit's first epoch from where it starts, every later one from 0."""
        if self._opened is not None and self._opened[0] == epoch:
            (_, batches), self._opened = self._opened, None
            return batches, self.skip
        return self.pipeline.train_epoch(self.loader, epoch, 0, self._path()), 0

    def example(self) -> DeviceBatch:
        """The first batch of epoch 0, for shapes."""
        return self.pipeline.example_batch(self.loader, self._path())

    def batches_left(self, skip: int, until_max_steps: int | None) -> int | None:
        """Batches an epoch runs from batch ``skip``: the epoch's rest, or fewer
        when ``until_max_steps`` batches reach ``max_steps`` first (``None``:
        unknown, a loader without a length and no step limit)."""
        if self.per_epoch is None:
            return until_max_steps
        n = self.per_epoch - skip
        return n if until_max_steps is None else min(n, until_max_steps)

    @staticmethod
    def groups(
        batches: Iterable[Any], skip: int, ends: Callable[[int, int], bool]
    ) -> Iterator[Group]:
        """``batches`` (the epoch's from batch ``skip``) in groups: a group ends
        after batch ``i`` when ``ends(i, size)``, and at the batches' end. The
        rule is asked lazily, after the previous group was handled."""
        group: Group = []
        for batch_idx, batch in enumerate(batches, start=skip):
            group.append((batch_idx, batch))
            if ends(batch_idx, len(group)):
                yield group
                group = []
        if group:  # a loader without a length ran out
            yield group


def batching(processes: int, batch_size: int | None) -> dict[str, int] | None:
    """How a run cuts its training batches, as a checkpoint records it: each of
    ``processes`` takes ``batch_size`` rows of the epoch's order per batch."""
    if batch_size is None:
        return None
    return {"processes": processes, "batch_size": batch_size}


def rebatched(
    meta: Mapping[str, Any] | None,
    skip: int,
    *,
    processes: int,
    batch_size: int | None,
    num_examples: int | None,
) -> int:
    """The batch to resume an epoch from when this run cuts its batches unlike
    the checkpoint's run did (another process count, another batch size).

    The Trainer's order gives global batch ``k`` (all processes' batch ``k``)
    the positions ``[k*B, (k+1)*B)`` of the epoch's order, ``B`` the global
    batch size, on any number of processes: a checkpoint after ``skip`` batches
    of ``B`` rows has consumed ``skip*B`` examples, and a run with global batch
    ``B'`` goes on at its batch ``skip*B / B'`` — the same next example.
    """
    saved = (meta or {}).get("progress", {}).get("batching")
    if not skip or not saved or batch_size is None:
        return skip
    before, now = saved["processes"] * saved["batch_size"], processes * batch_size
    if before == now:
        return skip
    consumed = skip * before
    if num_examples is not None and consumed >= num_examples:  # the epoch's last batch
        return -(-num_examples // now)
    if consumed % now:
        raise ValueError(
            f"the checkpoint was taken after {consumed} examples of its epoch ({skip} "
            f"batches of {saved['batch_size']} on each of {saved['processes']} "
            f"process(es)); this run's global batch is {processes} x {batch_size} = {now}, "
            f"which does not divide {consumed}, so no batch of it starts at the next "
            "example. Choose a batch size whose global batch divides it, or resume from "
            "a checkpoint taken at an epoch's end"
        )
    return consumed // now


def data_state(
    meta: Mapping[str, Any] | None, loader: Any, skip: int, processes: int, rank: int
) -> tuple[dict | None, int]:
    """This process's saved iterator state of a stateful training loader (grain's)
    and the batch of the epoch it resumes at (``skip`` on the checkpoint's
    process count). On another process count, a grain ``DataLoader``'s states
    are carried to this run's layout at the same global position (`regrain`)."""
    states = (meta or {}).get("progress", {}).get("data_state")
    if not states:
        return None, skip
    if len(states) == processes:
        return states[rank], _rebatched_grain(states, loader, skip)
    where = (
        f"the checkpoint holds the data iterators' states of {len(states)} process(es), and "
        f"this run has {processes}"
    )
    if not isinstance(loader, grain_data_loader()):
        raise ValueError(
            f"{where}: a grain dataset's state is its own shard's position, which another "
            "process count cannot continue (a grain DataLoader's can be carried over). "
            f"Resume on {len(states)} process(es), or from a checkpoint taken at an epoch's end"
        )
    saved = [json.loads(decode(state)) for state in states]
    try:
        position = regrain.consumed(saved)
        state, batches = regrain.state_at(position, regrain.layout(loader), saved[0])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if batches != skip and distributed.is_rank_zero():
        print(
            f"resuming a grain DataLoader of {len(states)} process(es) on {processes}: at "
            f"record {position} of its order, batch {batches} of the epoch here "
            f"(batch {skip} there)",
            flush=True,
        )
    return encode(json.dumps(state, indent=4).encode()), batches


def _rebatched_grain(states: list[dict], loader: Any, skip: int) -> int:
    """On the checkpoint's process count, a grain ``DataLoader``'s own state goes
    on as it is; the batch of the epoch it stands at is counted in this run's
    batch size where that can be read (else ``skip``, the checkpoint's count)."""
    if not isinstance(loader, grain_data_loader()):
        return skip
    try:
        saved = [json.loads(decode(state)) for state in states]
        position, layout = regrain.consumed(saved), regrain.layout(loader)
    except (ValueError, TypeError, KeyError):
        return skip  # grain goes on from its own state; the count stays the checkpoint's
    try:
        return regrain.state_at(position, layout, saved[0])[1]
    except ValueError as exc:
        warnings.warn(
            f"resuming the grain DataLoader at record {position} of its order, from its own "
            f"state; its batches are counted from the checkpoint's batch {skip}, since {exc}",
            stacklevel=4,
        )
        return skip
