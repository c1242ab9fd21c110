"""The host data path: conversion, padding with a mask, prefetching."""

import threading

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


class Counting(Dataset):
    def __init__(self, n):
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return np.float32(i)


def test_trainer_order_is_seeded_per_epoch_and_resumes_without_loading_skipped():
    from jaxlightning.sampling import epoch_loader

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
    from jaxlightning.sampling import epoch_loader

    batches = [np.full(2, i) for i in range(5)]
    with pytest.warns(UserWarning, match="loading and dropping 2 batches"):
        rest = list(epoch_loader(batches, epoch=0, seed=0, skip_batches=2))
    assert [int(b[0]) for b in rest] == [2, 3, 4]
