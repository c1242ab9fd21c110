"""The host data path: conversion, padding with a mask, prefetching."""

import threading

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from jaxlightning.data import Padder, Prefetcher, to_numpy


def test_tensors_become_numpy_without_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    out = to_numpy({"x": t})
    assert isinstance(out["x"], np.ndarray)
    assert np.shares_memory(out["x"], t.numpy())


def test_tensors_that_need_grad_or_other_dtypes_become_their_values():
    """A tensor that requires grad, an integer one, a boolean one, a parameter
    (a tensor subclass): each becomes the numpy array of its values."""
    w = torch.arange(6.0).reshape(3, 2).requires_grad_()
    batch = (w, torch.arange(3), torch.tensor([True, False, True]), torch.nn.Parameter(w.detach()))
    out = to_numpy(batch)
    assert [a.dtype for a in out] == [np.float32, np.int64, np.bool_, np.float32]
    for a, t in zip(out, batch, strict=True):
        np.testing.assert_array_equal(a, t.detach().numpy())


def test_nested_tuples_lists_dicts_keep_their_structure():
    batch = {"img": (torch.zeros(4, 2), [np.ones((4, 1)), {"deep": torch.ones(4)}])}
    out = to_numpy(batch)
    assert out["img"][1][1]["deep"].shape == (4,)
    assert isinstance(out["img"], tuple) and isinstance(out["img"][1], list)


def test_python_number_list_is_rejected_by_name():
    """A list of numbers is a pytree of scalars, not an array: rejected by name."""
    from jaxlightning.data import BatchError

    with pytest.raises(BatchError, match=r"batch\['y'\]\[0\] is a scalar"):
        to_numpy({"x": np.zeros((4, 2)), "y": [1, 2, 3, 4]})


def test_bfloat16_tensors_keep_their_values():
    t = torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16)
    out = to_numpy(t)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), [[1.5, -2.25]])


def test_partial_batch_is_padded_to_fixed_size_with_mask():
    pad = Padder(multiple=8, batch_size=20)  # 20 rounds up to 24
    x = np.arange(10, dtype=np.float32)[:, None]
    out = pad((x, np.arange(10)))
    assert pad.size == 24 and out.real == 10
    assert out.data[0].shape == (24, 1) and out.mask.sum() == 10
    np.testing.assert_array_equal(out.data[0][:10], x)
    np.testing.assert_array_equal(out.data[0][10:], 9.0)  # copies of the last real row
    assert out.mask[:10].all() and not out.mask[10:].any()


def test_full_batch_is_not_copied():
    pad = Padder(multiple=8, batch_size=16)
    x = np.zeros((16, 3), np.float32)
    assert pad(x).data is x


def test_larger_batch_grows_the_size_with_a_warning():
    pad = Padder(multiple=8, batch_size=8)
    with pytest.warns(UserWarning, match="larger than the fixed batch size 8"):
        out = pad(np.zeros((12, 1)))
    assert out.mask.shape == (16,)


class Slow(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return np.float32(i)


def test_prefetcher_yields_in_order_and_stops_early():
    fetched = []
    prefetcher = Prefetcher(DataLoader(Slow(), batch_size=10), lambda b: fetched.append(1) or b)
    it = iter(prefetcher)
    first, second = next(it), next(it)
    np.testing.assert_array_equal(first.numpy(), np.arange(10))
    np.testing.assert_array_equal(second.numpy(), np.arange(10, 20))
    prefetcher.close()
    assert not any(t.name == "jl-prefetch" and t.is_alive() for t in threading.enumerate())
    assert len(fetched) < 10  # bounded look-ahead, not the whole epoch


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_prefetcher_hands_over_every_item_in_order_within_its_depth(depth):
    """Each side is woken only when the other waits; whichever side is slower,
    every item arrives once, in order, never more than ``depth`` ahead, and an
    error in ``prepare`` arrives after the items before it."""
    import random
    import time

    rng = random.Random(depth)
    prepared, consumed = [0], [0]
    ahead = []

    def prepare(i):
        if rng.random() < 0.3:
            time.sleep(0.0005)  # a slower producer now and then
        if i == 150:
            raise KeyError("item 150")
        prepared[0] += 1
        ahead.append(prepared[0] - consumed[0])
        return i

    got = []
    with pytest.raises(KeyError, match="item 150"):
        for item in Prefetcher(range(200), prepare, depth=depth):
            consumed[0] += 1
            got.append(item)
            if rng.random() < 0.3:
                time.sleep(0.0005)  # a slower consumer now and then
    assert got == list(range(150))
    # beyond the `depth` waiting: one being prepared, one taken but not yet counted
    assert max(ahead) <= depth + 2


class Counting(Dataset):
    def __init__(self, n):
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return np.float32(i)


def test_trainer_order_is_seeded_per_epoch_and_resumes_without_loading_skipped():
    from jaxlightning.data.sampling import epoch_loader

    data = Counting(40)
    user = DataLoader(data, batch_size=8, shuffle=True)
    epoch1 = [b.numpy() for b in epoch_loader(user, epoch=1, seed=3)]
    again = [b.numpy() for b in epoch_loader(user, epoch=1, seed=3)]
    epoch2 = np.concatenate([b.numpy() for b in epoch_loader(user, epoch=2, seed=3)])
    assert all(np.array_equal(a, b) for a, b in zip(epoch1, again, strict=True))
    assert sorted(np.concatenate(epoch1)) == list(range(40))  # a permutation
    assert not np.array_equal(np.concatenate(epoch1), epoch2)  # reshuffled per epoch

    data.loaded.clear()
    rest = [b.numpy() for b in epoch_loader(user, epoch=1, seed=3, skip_batches=3)]
    assert all(np.array_equal(a, b) for a, b in zip(rest, epoch1[3:], strict=True))
    assert sorted(data.loaded) == sorted(np.concatenate(epoch1[3:]).astype(int).tolist())


def test_unowned_loader_is_skipped_by_loading_with_a_warning():
    from jaxlightning.data.sampling import epoch_loader

    batches = [np.full(2, i) for i in range(5)]
    with pytest.warns(UserWarning, match="loading and dropping 2 batches"):
        rest = list(epoch_loader(batches, epoch=0, seed=0, skip_batches=2))
    assert [int(b[0]) for b in rest] == [2, 3, 4]


def _per_example_batches(ds, batch_sampler):
    """The reference: one __getitem__ per example, then torch's default collate."""
    from torch.utils.data import default_collate

    return [default_collate([ds[i] for i in idx]) for idx in batch_sampler]


@pytest.mark.parametrize("drop_last", [False, True])
def test_tensor_dataset_batches_are_fetched_whole_and_equal_per_example_ones(
    monkeypatch, drop_last
):
    from torch.utils.data import BatchSampler, TensorDataset

    from jaxlightning.data.convert import to_numpy
    from jaxlightning.data.sampling import EpochSampler, IndexedEpoch, epoch_loader, whole_batches

    x = torch.randn(40, 3)
    ds = TensorDataset(x, torch.arange(40), x.to(torch.bfloat16))
    user = DataLoader(ds, batch_size=7, shuffle=True, drop_last=drop_last)
    sampler = EpochSampler(40, shuffle=True, seed=5, epoch=2, start=7)  # resumed at batch 1
    expected = _per_example_batches(ds, BatchSampler(sampler, 7, drop_last))

    indexed_with = []
    getitem = TensorDataset.__getitem__

    def spy(self, index):
        indexed_with.append(type(index))
        return getitem(self, index)

    monkeypatch.setattr(TensorDataset, "__getitem__", spy)
    # Read in the main process: indexed from the numpy arrays, no __getitem__ at all
    epoch = epoch_loader(user, epoch=2, seed=5, skip_batches=1)
    assert isinstance(epoch, IndexedEpoch)
    indexed = list(epoch)
    assert not indexed_with
    # Through a DataLoader (workers, or an order the Trainer does not own): one
    # indexing per batch
    placed = DataLoader(ds, batch_size=7, sampler=sampler, drop_last=drop_last)
    fetched = list(whole_batches(placed))
    assert indexed_with and set(indexed_with) == {list}
    assert len(indexed) == len(fetched) == len(expected) == (4 if drop_last else 5)
    for i, f, e in zip(indexed, fetched, expected, strict=True):
        assert type(f) is type(e) is type(i) is list
        for a, b, c in zip(f, e, i, strict=True):
            assert a.dtype == b.dtype
            assert torch.equal(a, b)
            want = to_numpy(b)
            assert c.dtype == want.dtype and np.array_equal(c, want)


class _Samples(Dataset):
    """Per-example samples of several kinds; each ``__getitem__`` draws from
    torch's global generator (an augmentation), so a fetch that drew apart from
    the DataLoader's own would give other numbers."""

    def __init__(self, kind: str, n: int = 23) -> None:
        self.kind, self.x = kind, torch.randn(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        assert type(i) is int  # as the DataLoader's sampler gives them
        x = self.x[i] + torch.rand(3)
        if self.kind == "tuple":
            return x, torch.tensor(i)
        if self.kind == "dict":
            return {"x": x.to(torch.bfloat16), "i": torch.tensor(i)}
        return x.numpy(), i, float(i)  # numpy and numbers: default collate's other kinds


class _Many(_Samples):
    def __init__(self) -> None:
        super().__init__("tuple")
        self.asked: list = []

    def __getitems__(self, indices):
        self.asked.append(indices)
        return [(self.x[i] * 2, torch.tensor(i)) for i in indices]


@pytest.mark.parametrize(
    "dataset, collate, drop_last",
    [
        (lambda: _Samples("tuple"), None, False),
        (lambda: _Samples("dict"), None, True),
        (lambda: _Samples("mixed"), None, False),
        (_Many, None, False),
        (lambda: _Samples("tuple"), lambda rows: [r[0].sum() for r in rows], False),
    ],
    ids=["tuples", "dicts", "numpy-and-numbers", "getitems", "custom-collate"],
)
def test_per_example_batches_fetched_by_the_trainer_equal_the_dataloaders(
    dataset, collate, drop_last
):
    """Read in the main process, a per-example DataLoader's batches are fetched
    without its iterator: the same indices (Python ints, ``__getitems__`` where
    the dataset has it), the same collate result, the same draws from torch's
    generator, as the rebuilt DataLoader gives."""
    from jaxlightning.data.fetch import FetchedEpoch
    from jaxlightning.data.sampling import EpochSampler, epoch_loader

    ds = dataset()
    kw = {} if collate is None else {"collate_fn": collate}
    user = DataLoader(ds, batch_size=5, shuffle=True, drop_last=drop_last, **kw)
    torch.manual_seed(0)
    epoch = epoch_loader(user, epoch=1, seed=4, skip_batches=1)
    assert isinstance(epoch, FetchedEpoch)
    ours = list(epoch)
    asked = list(getattr(ds, "asked", []))
    torch.manual_seed(0)
    sampler = EpochSampler(len(ds), shuffle=True, seed=4, epoch=1, start=5)
    theirs = list(DataLoader(ds, batch_size=5, sampler=sampler, drop_last=drop_last, **kw))
    assert len(ours) == len(theirs) == (3 if drop_last else 4)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if asked:  # one call per batch, with the sampler's Python ints
        assert asked == ds.asked[len(asked) :] and all(type(i) is int for i in asked[0])


def test_the_default_collation_shortcut_leaves_unlike_samples_to_default_collate():
    """The Trainer stacks tuples of tensors itself (`fetch.stacked`); samples
    unlike the first (another length, a field that is no tensor, a sparse
    tensor) get default_collate's own error."""
    from torch.utils.data import default_collate

    from jaxlightning.data.fetch import stacked

    a, b = torch.arange(3.0), torch.tensor(1)
    same = stacked([(a, b), (a + 1, b)])
    assert type(same) is list and torch.equal(same[0], torch.stack([a, a + 1]))

    def error(collate, samples):
        with pytest.raises(Exception) as info:
            collate(samples)
        return type(info.value), str(info.value)

    sparse = a.to_sparse()
    for unlike in ([(a, b), (a,)], [(a, b), (a, 1)], [(sparse, b), (sparse, b)]):
        assert error(stacked, unlike) == error(default_collate, unlike)


@pytest.mark.parametrize("per_example", [False, True], ids=["tensors", "per-example"])
def test_an_epoch_resumed_at_its_short_last_batch_keeps_the_loaders_batch_size(per_example):
    """The batches are padded to the loader's batch size, not to the first
    batch's rows: an epoch resumed at its short last batch compiles nothing new
    (a run resumed there once trained on other shapes than the straight run)."""
    from torch.utils.data import TensorDataset

    from jaxlightning.data.convert import loader_batch_size
    from jaxlightning.data.sampling import epoch_loader

    x = torch.randn(20, 3)
    ds = _Samples("tuple", n=20) if per_example else TensorDataset(x)
    epoch = epoch_loader(DataLoader(ds, batch_size=8), epoch=0, seed=0, skip_batches=2)
    assert [len(jax.tree.leaves(b)[0]) for b in epoch] == [4]
    assert loader_batch_size(epoch) == 8


def test_per_example_loaders_read_by_workers_or_pinned_stay_dataloaders():
    from jaxlightning.data.fetch import FetchedEpoch
    from jaxlightning.data.sampling import epoch_loader

    ds = _Samples("tuple")
    for kw in ({"num_workers": 1}, {"pin_memory": True}):
        epoch = epoch_loader(DataLoader(ds, batch_size=4, **kw), epoch=0, seed=0)
        assert isinstance(epoch, DataLoader) and not isinstance(epoch, FetchedEpoch)


def test_whole_batches_keep_a_loaders_own_shuffled_order():
    from torch.utils.data import TensorDataset

    from jaxlightning.data.sampling import whole_batches

    ds = TensorDataset(torch.arange(30))

    def user():
        gen = torch.Generator().manual_seed(9)
        return DataLoader(ds, batch_size=4, shuffle=True, generator=gen)

    plain, whole = user(), whole_batches(user())
    assert whole is not plain
    for _ in range(2):  # the second epoch draws a new order from the same generator
        a, b = [t[0] for t in plain], [t[0] for t in whole]
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    custom = DataLoader(ds, batch_size=4, collate_fn=lambda rows: rows)
    assert whole_batches(custom) is custom  # a custom collate keeps per-example fetching


def test_cpu_fit_loads_with_one_torch_thread_and_restores_the_setting():
    import jaxlightning as jl
    from tests.helpers import LitMLP, digits, quiet_trainer

    seen, loading = [], []

    class Threads(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            seen.append(torch.get_num_threads())

    def collate(rows):  # runs on the loading thread
        from torch.utils.data import default_collate

        loading.append(torch.get_num_threads())
        return default_collate(rows)

    x, y = digits(64)
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trainer = quiet_trainer(max_steps=2, callbacks=[Threads()])
        trainer.fit(LitMLP(), DataLoader(data, batch_size=32, collate_fn=collate))
        assert seen == [1, 1]
        assert loading and set(loading) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


class _DigitRows(Dataset):
    """The digits behind a per-example ``__getitem__`` (the Trainer fetches it)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@pytest.mark.parametrize(
    "per_example, depth, threaded",
    [(True, None, False), (False, None, True), (True, 2, True)],
    ids=["per-example", "tensors", "per-example-depth-2"],
)
def test_per_example_loading_runs_in_the_loop_on_cpu_unless_asked(per_example, depth, threaded):
    """On the CPU backend a per-example Dataset the Trainer fetches itself is
    read in the loop's own thread (its Python holds the GIL: a thread only
    adds hand-overs); whole-batch loading keeps the prefetch thread, and so
    does a ``prefetch_depth`` the user sets. The trained parameters are the
    same bits either way."""
    from torch.utils.data import TensorDataset

    import jaxlightning as jl
    from tests.helpers import (
        LitMLP,
        assert_bitwise_equal,
        digits,
        init_mlp,
        quiet_trainer,
        trained_params,
    )

    x, y = digits(96)
    tensors = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    ds = _DigitRows(x, y) if per_example else tensors
    prefetching = []

    class Watch(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            prefetching.append(any(t.name == "jl-prefetch" for t in threading.enumerate()))

    def fit(strategy):
        # on the host path (resident data has no thread to decide on)
        trainer = quiet_trainer(
            max_epochs=1, devices=1, strategy=strategy, callbacks=[Watch()], data_on_device=False
        )
        trainer.fit(LitMLP(init_variables=init_mlp()), DataLoader(ds, batch_size=16))
        return trained_params(trainer)

    params = fit(jl.ShardMapStrategy(prefetch_depth=depth))
    # after the first batch, a thread with 5 batches to go still runs (it may
    # have prepared all of them and ended before the last)
    assert len(prefetching) == 6 and prefetching[0] == threaded
    if not threaded:
        assert not any(prefetching)
    assert_bitwise_equal(params, fit(jl.ShardMapStrategy(prefetch_depth=1 if depth is None else 0)))


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("managed", [None, "frozen", "disabled"])
def test_a_full_collection_in_a_call_freezes_the_heap_it_found_until_the_call_ends(managed):
    """A per-example loader sends objects to the collector's oldest generation
    each step; a full collection then visits the whole heap of JAX, Flax and
    torch. The first full collection in a Trainer call is followed by
    ``gc.freeze``, undone when the call ends; cycles made in the call are still
    collected. A process that manages its collector is left as it is."""
    import gc
    import weakref

    import jaxlightning as jl
    from tests.helpers import LitMLP, digits, init_mlp, quiet_trainer

    assert gc.get_freeze_count() == 0 and gc.isenabled()
    callbacks = list(gc.callbacks)
    seen = {}

    class Collect(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            if batch_idx == 1:
                gc.collect()
                seen["frozen"] = gc.get_freeze_count()
                cycle = _Cycle()
                seen["cycle"] = weakref.ref(cycle)
                del cycle
            elif batch_idx == 2:
                gc.collect()
                seen["cycle_collected"] = seen["cycle"]() is None

    x, y = digits(64)
    trainer = quiet_trainer(max_epochs=1, devices=1, callbacks=[Collect()])
    if managed == "frozen":
        gc.freeze()
    elif managed == "disabled":
        gc.disable()
    before = gc.get_freeze_count()
    try:
        trainer.fit(LitMLP(init_variables=init_mlp()), DataLoader(_DigitRows(x, y), batch_size=16))
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
        gc.enable()
    assert seen["cycle_collected"]
    assert gc.callbacks == callbacks
    if managed is None:
        assert before == 0 and seen["frozen"] > 10_000 and after == 0
    else:  # what the process froze stays frozen (less what was freed), nothing more
        assert seen["frozen"] <= before and after <= before
        assert managed == "disabled" or after > 10_000


class _Recorded(_DigitRows):
    """Records the rows it is asked for; row ``bad`` raises."""

    def __init__(self, x: np.ndarray, y: np.ndarray, bad: int | None = None) -> None:
        super().__init__(x, y)
        self.loaded: list[int] = []
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"row {i} is unreadable")
        self.loaded.append(i)
        return super().__getitem__(i)


@pytest.mark.parametrize(
    "device_busy, in_flight, ends",
    [
        (False, None, [15, 47, 47, 79, 79, 95]),  # after a report, the next batch only
        (True, None, [15, 95, 95, 95, 95, 95]),  # the rest (6 batches: under the bound)
        (True, 2, [15, 63, 63, 95, 95, 95]),  # two batches, the bound
    ],
    ids=["device-done", "device-busy", "device-busy-bound-2"],
)
def test_a_report_loads_batches_ahead_while_the_steps_it_waits_for_run(
    monkeypatch, device_busy, in_flight, ends
):
    """With loading in the loop's thread, a report (which waits for the steps in
    flight to read their metrics) first loads the next batch, and more while
    the device still runs them (up to the in-flight bound), so that they load
    during the wait; other steps load theirs when they come. An error loading
    a batch ahead is raised at that batch, after the report's batch hooks."""
    import jaxlightning as jl
    from jaxlightning.programs.held_state import HeldState
    from tests.helpers import LitMLP, digits, init_mlp, quiet_trainer

    # the device's state at the report, fixed: the steps are done, or still run
    monkeypatch.setattr(HeldState, "busy", lambda self: device_busy)
    x, y = digits(96)
    events: list[tuple[str, int, int]] = []

    def fit(ds):
        class Watch(jl.Callback):
            def on_train_batch_start(self, trainer, module, batch_idx):
                events.append(("start", batch_idx, max(ds.loaded)))

            def on_train_batch_end(self, trainer, module, batch_idx):
                events.append(("end", batch_idx, max(ds.loaded)))

        # reports after steps 2, 4 and 6 (batches 1, 3, 5) of 16-row batches
        trainer = quiet_trainer(
            max_epochs=1,
            devices=1,
            log_every_n_steps=2,
            callbacks=[Watch()],
            strategy=jl.ShardMapStrategy(max_in_flight=in_flight),
        )
        trainer.fit(LitMLP(init_variables=init_mlp()), DataLoader(ds, batch_size=16))

    fit(_Recorded(x, y))
    assert [last for what, _, last in events if what == "end"] == ends
    events.clear()
    with pytest.raises(ValueError, match="row 40 is unreadable"):
        fit(_Recorded(x, y, bad=40))  # in batch 2, loaded ahead at batch 1's report
    hooks = [(what, i) for what, i, _ in events]
    assert hooks == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]


def test_loading_ahead_stops_when_told_at_the_end_or_at_an_error():
    """`Prefetcher.load_ahead` (``depth=0``) loads one item, then more while
    ``more(number waiting)``; never past the end or an error, which is raised
    where its item would have been."""
    from jaxlightning.data.prefetch import Prefetcher

    loaded: list[int] = []

    def prepare(i: int) -> int:
        if i == 6:
            raise ValueError("item 6 is bad")
        loaded.append(i)
        return i

    asked: list[int] = []

    def more(waiting: int) -> bool:
        asked.append(waiting)
        return waiting < 3

    items = Prefetcher(range(10), prepare, depth=0)
    items.load_ahead(more)
    assert loaded == [0, 1, 2] and asked == [1, 2, 3]  # one, then while `more`
    items.load_ahead(more)
    assert loaded == [0, 1, 2] and asked[3:] == [3]  # three wait already
    it = iter(items)
    assert [next(it), next(it), next(it)] == [0, 1, 2] and loaded == [0, 1, 2]
    items.load_ahead(lambda waiting: True)
    assert loaded == [0, 1, 2, 3, 4, 5]  # until the error, kept as item 6
    assert [next(it) for _ in range(3)] == [3, 4, 5]
    with pytest.raises(ValueError, match="item 6 is bad"):
        next(it)  # the error loaded ahead, where item 6 would have been
    short = Prefetcher(range(2), lambda i: i, depth=0)
    short.load_ahead(lambda waiting: True)
    assert list(short) == [0, 1]  # the end stops loading ahead
