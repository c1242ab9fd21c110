"""Datasets resident on the devices (`Trainer(data_on_device=...)`): the same
batches, padding, masks and resume positions as the host path, so the same
parameters bit for bit; the host path where residence is not exact or not
possible; and arrays accepted where loaders go."""

import jax
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import jaxlightning as jl
from jaxlightning.data.resident import ResidentBatch
from tests.helpers import LitMLP, digits, init_mlp, loader, quiet_trainer

X, Y = digits(203)  # 203 rows: batches of 16 leave an uneven last batch of 11
XV, YV = digits(61, offset=400)


class Reports(jl.Callback):
    """The metrics after each train batch (the reports' values as they come)."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, batch_idx):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(data_on_device, train, val=None, ckpt_path=None, callbacks=None, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    trainer = quiet_trainer(data_on_device=data_on_device, callbacks=callbacks, **kwargs)
    module = LitMLP(init_variables=init_mlp(), dropout=0.1)
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return trainer


def _same_params(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)
    pairs = zip(leaves_a, leaves_b, strict=True)
    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in pairs)


@pytest.mark.parametrize(
    "shuffle, drop_last, kwargs",
    [
        (True, False, {}),
        (False, True, {}),
        (True, False, {"limit_train_batches": 5, "max_epochs": 3}),
        (True, False, {"devices": 2, "accumulate_grad_batches": 2}),
    ],
    ids=["shuffled-uneven-last", "in-order-drop-last", "limited", "two-devices-accumulated"],
)
def test_resident_training_is_bitwise_the_host_path(shuffle, drop_last, kwargs):
    def loaders():
        train = DataLoader(
            TensorDataset(torch.from_numpy(X), torch.from_numpy(Y)),
            batch_size=16,
            shuffle=shuffle,
            drop_last=drop_last,
        )
        return train, loader(XV, YV, 16)

    host_reports, device_reports = Reports(), Reports()
    kwargs.setdefault("log_every_n_steps", 2)
    host = _fit(False, *loaders(), callbacks=[host_reports], **kwargs)
    device = _fit(True, *loaders(), callbacks=[device_reports], **kwargs)
    assert host.data_path == "host" and device.data_path == "device"
    assert host.global_step == device.global_step > 0
    assert _same_params(host, device)
    # the validation (on the device too) and training metrics agree exactly,
    # at every report (each step's rows gathered in its own dispatch)
    assert host.callback_metrics.keys() == device.callback_metrics.keys()
    for name, value in host.callback_metrics.items():
        assert float(value) == float(device.callback_metrics[name]), name
    assert host_reports.seen == device_reports.seen
    assert len({str(r) for r in host_reports.seen}) > 4  # reports changed the values


def test_a_resident_batch_is_gathered_in_its_train_steps_dispatch(compiles, monkeypatch):
    gathered = []
    plain_gather = ResidentBatch._gathered

    def counted(batch):
        if batch._placed is None:  # gathered now (not asked for again)
            gathered.append(batch)
        return plain_gather(batch)

    monkeypatch.setattr(ResidentBatch, "_gathered", counted)
    trainer = _fit(True, loader(X, Y, 16, shuffle=True), max_epochs=2)
    assert trainer.data_path == "device" and trainer.global_step == 26
    # one program a step, compiled once: the train step with its rows' gather
    assert compiles.matching("jl_train_step_gathered") == 1, compiles.counts
    assert compiles.matching("jl_train_step") == 1, compiles.counts
    # no batch gathered in a dispatch of its own
    assert gathered == []
    # an evaluation's batches too are gathered in its step's dispatch
    trainer.validate(trainer.lightning_module, loader(XV, YV, 16))
    assert compiles.matching("jl_eval_step_gathered") == 1, compiles.counts
    assert gathered == [] and compiles.matching("_gather)") == 0, compiles.counts
    # a batch's data asked for apart (predict's, a callback's) still is
    trainer.predict(trainer.lightning_module, loader(XV, YV, 16))
    assert len(gathered) == 4  # its 4 batches (61 rows, 16 a batch)


def test_the_memory_check_compiles_a_resident_fits_plain_step_from_shapes(compiles):
    # With the device's memory known the check counts the plain step too,
    # compiled from the batch's shapes: no batch gathered apart for it.
    trainer = _fit(True, loader(X, Y, 16, shuffle=True), max_epochs=1, device_memory=2**30)
    assert trainer.data_path == "device" and trainer.global_step == 13
    assert compiles.matching("jl_train_step_gathered") == 1, compiles.counts
    assert compiles.matching("jl_train_step)") == 1, compiles.counts  # the plain one
    assert compiles.matching("_gather)") == 0, compiles.counts


def test_resident_mid_epoch_resume_is_bitwise_an_uninterrupted_host_run(tmp_path):
    train = loader(X, Y, 16, shuffle=True)
    straight = _fit(False, train, max_epochs=2)
    # 13 batches an epoch: stop after 17 steps, mid-epoch 1, and resume on the device
    ckpt = jl.ModelCheckpoint(tmp_path, every_n_train_steps=17, save_top_k=-1, async_save=False)
    _fit(True, train, max_steps=17, callbacks=[ckpt])
    resumed = _fit(True, train, ckpt_path=str(tmp_path / "17"), max_epochs=2)
    assert resumed.global_step == straight.global_step == 26
    assert _same_params(straight, resumed)


def test_auto_chooses_the_device_and_falls_back_where_it_is_not_exact():
    tensors = TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    assert _fit("auto", DataLoader(tensors, batch_size=16), max_steps=1).data_path == "device"

    # a per-example dataset, a custom collate, an order the Trainer does not own
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(X)

        def __getitem__(self, i):
            return X[i], Y[i]

    def collate(rows):
        return torch.utils.data.default_collate(rows)

    for train, kwargs in [
        (DataLoader(Rows(), batch_size=16), {}),
        (DataLoader(tensors, batch_size=16, collate_fn=collate), {}),
        (DataLoader(tensors, batch_size=16, shuffle=True), {"use_distributed_sampler": False}),
    ]:
        assert _fit("auto", train, max_steps=1, **kwargs).data_path == "host"
    # pmap places per-device arrays itself
    pmapped = _fit("auto", DataLoader(tensors, batch_size=16), max_steps=1, strategy="pmap")
    assert pmapped.data_path == "host"


def test_data_on_device_true_says_why_it_cannot():
    rows = [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 64, 16)]
    with pytest.raises(ValueError, match="data_on_device=True.*TensorDataset"):
        _fit(True, rows, max_steps=1)
    with pytest.raises(ValueError, match="data_on_device must be"):
        quiet_trainer(data_on_device="yes")


def test_summary_says_which_path_a_fit_uses(capsys):
    train = loader(X, Y, 16)
    _fit(True, train, max_steps=1, enable_model_summary=True)
    assert "Data: on the devices" in capsys.readouterr().out
    _fit(False, train, max_steps=1, enable_model_summary=True)
    assert "Data: from the host" in capsys.readouterr().out


def test_arrays_go_where_loaders_go():
    # fit on (x, y) = a shuffled DataLoader of 32 over the same rows, bit for bit
    by_arrays = _fit("auto", (X, Y), (XV, YV))
    by_loader = _fit("auto", loader(X, Y, 32, shuffle=True), loader(XV, YV, 32))
    assert by_arrays.data_path == "device"
    assert by_arrays.global_step == by_loader.global_step == 2 * 7  # ceil(203 / 32) a epoch
    assert _same_params(by_arrays, by_loader)
    assert by_arrays.callback_metrics["val/acc"] == by_loader.callback_metrics["val/acc"]

    # jl.arrays chooses the batch size; JAX and torch arrays are taken too
    module = LitMLP(init_variables=init_mlp())
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(module, jl.arrays((jax.numpy.asarray(X), torch.from_numpy(Y)), batch_size=64))
    assert trainer.global_step == 4  # ceil(203 / 64)

    # validate and predict take arrays in dataset order
    (metrics,) = trainer.validate(module, (XV, YV))
    (on_loader,) = trainer.validate(module, loader(XV, YV, 16))
    assert metrics["val/acc"] == pytest.approx(on_loader["val/acc"], abs=1e-6)
    out = trainer.predict(module, (XV,), concatenate=True)
    expected = np.asarray(module.net.apply(module.variables, XV))
    np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-5)


def test_a_dict_of_arrays_is_one_batch_dict_and_bad_arrays_are_named():
    class DictMLP(LitMLP):
        def loss(self, variables, batch, rngs):
            return super().loss(variables, (batch["image"], batch["label"]), rngs)

    module = DictMLP(init_variables=init_mlp())
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(module, {"image": X, "label": Y})
    reference = LitMLP(init_variables=init_mlp())
    quiet_trainer(max_epochs=1).fit(reference, loader(X, Y, 32, shuffle=True))
    assert all(
        np.array_equal(np.asarray(u), np.asarray(v))
        for u, v in zip(
            jax.tree.leaves(module.variables), jax.tree.leaves(reference.variables), strict=True
        )
    )
    with pytest.raises(ValueError, match=r"one leading size.*image: 203, label: 10"):
        quiet_trainer(max_epochs=1).fit(DictMLP(), {"image": X, "label": Y[:10]})
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        jl.arrays((X, Y), batch_size=0)
    # the two probes of issue 61 that got unrelated errors: named now
    with pytest.raises(TypeError, match=r"a list is read as a list of batches.*make it a tuple"):
        quiet_trainer(max_epochs=1).fit(LitMLP(), [X, Y])
    with pytest.raises(ValueError, match=r"one leading size.*1: a scalar"):
        quiet_trainer(max_epochs=1).fit(LitMLP(), (X, np.float32(3.0)))
