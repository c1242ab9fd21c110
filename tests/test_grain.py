"""grain loaders where torch DataLoaders go: trained, evaluated, predicted, and
resumed mid-epoch from their iterator state without reading a batch twice."""

import json
import shutil

import grain
import numpy as np
import pytest

import jaxlightning as jl
from jaxlightning.io.checkpoint import read_meta
from tests.helpers import (
    LitMLP,
    assert_bitwise_equal,
    digits,
    init_mlp,
    loader,
    np_logits,
    quiet_trainer,
    trained_params,
)

X, Y = digits(200)


class Digits:
    """A grain data source that notes every index it is asked for."""

    def __init__(self, n=200):
        self.n, self.seen = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.seen.append(int(i))
        return X[i], Y[i]

    def __repr__(self):  # grain checks a restored state's source by its repr
        return f"Digits({self.n})"


def grain_loader(source, shuffle=True, batch_size=32):
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        shuffle=shuffle,
        seed=0,
        num_epochs=1,
        shard_options=grain.sharding.NoSharding(),
    )
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size=batch_size)],
        worker_count=0,
        read_options=grain.ReadOptions(num_threads=0),  # indices asked in order
    )


def grain_dataset(source):
    return (
        grain.MapDataset.source(source)
        .shuffle(seed=0)
        .batch(32)
        .to_iter_dataset(grain.ReadOptions(num_threads=0))
    )


def grain_map_dataset(source):  # iterated with grain's default read-ahead threads
    return grain.MapDataset.source(source).shuffle(seed=0).batch(32)


MAKERS = {"DataLoader": grain_loader, "IterDataset": grain_dataset, "MapDataset": grain_map_dataset}


def fit(data, tmp_path=None, ckpt_path=None, **kw):
    if tmp_path is not None:
        kw["default_root_dir"] = tmp_path
        kw["callbacks"] = [jl.ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)]
    trainer = quiet_trainer(max_epochs=2, **kw)
    module = LitMLP(lr=1e-2, init_variables=init_mlp())
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("kind", MAKERS)
def test_grain_trains_on_the_batches_it_yields(kind):
    batches = list(MAKERS[kind](Digits()))  # 6 of 32 and one of 8
    assert [len(b[1]) for b in batches] == [32] * 6 + [8]
    # Each epoch is a fresh pass of grain's (same seeded) order.
    assert_bitwise_equal(trained_params(fit(MAKERS[kind](Digits()))), trained_params(fit(batches)))


@pytest.mark.parametrize("kind", MAKERS)
def test_grain_resumes_mid_epoch_from_its_state_reading_nothing_twice(kind, tmp_path):
    straight_source = Digits()
    straight = fit(MAKERS[kind](straight_source), tmp_path / "straight")
    ckpt = tmp_path / "straight/checkpoints/3"  # 3 batches of 32 into epoch 0
    saved = read_meta(ckpt)["progress"]
    assert (saved["epoch"], saved["batch"]) == (0, 3)
    assert len(saved["data_state"]) == 1  # one per process

    source = Digits()
    resumed = fit(MAKERS[kind](source), tmp_path / "resumed", ckpt_path=ckpt)
    assert resumed.global_step == straight.global_step == 14
    assert_bitwise_equal(trained_params(resumed), trained_params(straight))
    assert len(source.seen) == 2 * 200 - 96  # no batch read and dropped
    if kind != "MapDataset":  # read in order (no read-ahead threads): the very indices
        assert source.seen == straight_source.seen[96:]

    # A record at an epoch's end holds no state: the next epoch is a fresh pass.
    _, record = straight.checkpoint_payload(straight.lightning_module)
    at_end = record["progress"]
    assert (at_end["epoch"], at_end["batch"]) == (2, 0) and "data_state" not in at_end


def test_grain_resumed_with_another_batch_size_counts_its_batches_in_it(tmp_path):
    """The checkpoint after 3 batches of 32 (96 records) resumes with batches of
    48 at batch 2 of the epoch, reading on from record 96."""
    fit(grain_loader(Digits()), tmp_path / "one")

    class Batches(jl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, module, batch_idx):
            self.seen.append((trainer.current_epoch, batch_idx))

    source, batches = Digits(), Batches()
    trainer = quiet_trainer(max_epochs=1, callbacks=[batches], enable_checkpointing=False)
    module = LitMLP(lr=1e-2, init_variables=init_mlp())
    ckpt = tmp_path / "one/checkpoints/3"
    trainer.fit(module, grain_loader(source, batch_size=48), ckpt_path=ckpt)
    assert batches.seen == [(0, 2), (0, 3), (0, 4)]  # 48, 48 and the last 8 of 200
    straight = Digits()
    list(grain_loader(straight))  # grain's own pass, in its order
    assert source.seen == straight.seen[96:]

    # Batches of 40 do not meet record 96: grain goes on there, counted as before.
    trainer = quiet_trainer(max_epochs=1, enable_checkpointing=False)
    module = LitMLP(lr=1e-2, init_variables=init_mlp())
    with pytest.warns(UserWarning, match=r"record 96 .* from the checkpoint's batch 3, since"):
        trainer.fit(module, grain_loader(Digits(), batch_size=40), ckpt_path=ckpt)
    assert trainer.global_step == 3 + 3  # 40, 40, 24


def test_grain_states_that_are_not_one_order_cut_by_process_are_refused(tmp_path):
    """Each saved state must be its process's shard of one order; a checkpoint
    whose 2 states are one process's twice (a loader not cut by process) has
    no position on 1 process. (Real resumes on another process count:
    test_multihost, test_regrain.)"""
    fit(grain_loader(Digits()), tmp_path / "one")
    ckpt = tmp_path / "copy"
    shutil.copytree(tmp_path / "one/checkpoints/3", ckpt)
    record = next(p for p in ckpt.rglob("*") if p.is_file() and p.parent.name == "meta")
    meta = json.loads(record.read_text())
    meta["progress"]["data_state"] *= 2  # as if 2 processes had read the same records
    record.write_text(json.dumps(meta))
    with pytest.raises(
        ValueError, match=r"states of 2 process\(es\), and this run has 1: process 0's saved data "
        r"state is not that of shard 0 of 2 \(its last records are at global positions \[95\]\)"
    ):  # fmt: skip
        fit(grain_loader(Digits()), ckpt_path=ckpt)


def test_grain_validates_and_predicts_in_its_order():
    vx, vy = digits(45, offset=1000)

    class Val(Digits):
        def __getitem__(self, i):
            return vx[i], vy[i]

    trainer = fit(grain_loader(Digits()))
    params = trained_params(trainer)
    val = grain_loader(Val(45), shuffle=False, batch_size=16)
    (metrics,) = trainer.validate(trainer.lightning_module, val)
    (reference,) = trainer.validate(trainer.lightning_module, loader(vx, vy, 16))
    assert metrics == reference
    logits = np_logits(params, vx)
    assert float(metrics["val/acc"]) == pytest.approx((logits.argmax(-1) == vy).mean(), abs=1e-7)
    predicted = trainer.predict(trainer.lightning_module, val, concatenate=True)
    np.testing.assert_allclose(predicted["logits"], logits, atol=1e-4)
