"""Several train steps per dispatch (`Trainer(steps_per_execution=k)`): bitwise
the training, the logged values and the checkpoints of one step per dispatch;
reports, validations and checkpoints at their exact steps; batch hooks once per
batch, told how far the state is ahead."""

import jax
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import jaxlightning as jl
from tests.helpers import LitMLP, digits, init_mlp, loader, quiet_trainer

X, Y = digits(203)  # 13 batches of 16 an epoch, the last of 11 rows
XV, YV = digits(61, offset=400)


class Seen(jl.Callback):
    """Records each batch hook's batch, step and how far the state is ahead."""

    def __init__(self):
        self.starts, self.ends, self.validations = [], [], []

    def on_train_batch_start(self, trainer, module, batch_idx):
        self.starts.append((batch_idx, trainer.global_step))

    def on_train_batch_end(self, trainer, module, batch_idx):
        self.ends.append((batch_idx, trainer.global_step, trainer.steps_ahead))

    def on_validation_start(self, trainer, module):
        if not trainer.sanity_checking:
            self.validations.append(trainer.global_step)


def _train_loader():
    tensors = TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    return DataLoader(tensors, batch_size=16, shuffle=True)


def _fit(tmp_path, k, data_on_device, callbacks=(), ckpt_path=None, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    seen = Seen()
    logger = jl.CSVLogger(tmp_path, name=f"k{k}", version=0, flush_logs_every_n_steps=1)
    trainer = quiet_trainer(
        steps_per_execution=k,
        data_on_device=data_on_device,
        callbacks=[seen, *callbacks],
        logger=logger,
        **kwargs,
    )
    module = LitMLP(init_variables=init_mlp(), dropout=0.1)
    trainer.fit(module, _train_loader(), loader(XV, YV, 16), ckpt_path=ckpt_path)
    csv = (tmp_path / f"k{k}" / "version_0" / "metrics.csv").read_text()
    return trainer, seen, csv


def _same_params(a, b):
    pairs = zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params), strict=True)
    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in pairs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "k, data_on_device, kwargs",
    [
        # reports every 3 steps, validations every 5 batches cut some groups
        (3, True, {"log_every_n_steps": 3, "val_check_interval": 5}),
        (3, False, {"devices": 2, "log_every_n_steps": 3, "val_check_interval": 5}),
        (4, True, {"devices": 2, "accumulate_grad_batches": 2, "log_every_n_steps": 2}),
        (4, True, {"max_steps": 7, "max_epochs": -1}),
        # the state split over the devices: the sharded step scanned alike
        (4, True, {"strategy": "fsdp", "devices": 2, "max_epochs": 1}),
    ],
    ids=["device", "host-two-devices", "device-accumulated", "max-steps", "fsdp"],
)
def test_groups_train_log_and_validate_bitwise_as_one_step_per_dispatch(
    tmp_path, compiles, k, data_on_device, kwargs
):
    one, seen_one, csv_one = _fit(tmp_path, 1, data_on_device, **kwargs)
    compiles.reset()
    many, seen_many, csv_many = _fit(tmp_path, k, data_on_device, **kwargs)
    # the group program ran (compiled once: shorter groups run step by step); with
    # the data on the device it gathers the group's rows itself (one dispatch)
    name = "jl_resident_steps" if data_on_device else "jl_train_steps"
    assert compiles.matching(name) == 1, compiles.counts
    assert compiles.matching("jl_resident_batches") == 0, compiles.counts
    assert many.global_step == one.global_step > 0
    assert _same_params(one, many)
    # every logged value at the same step, validations after the same batches
    assert csv_many == csv_one
    assert seen_many.validations == seen_one.validations
    # each batch's hooks once, seeing the step counts of one step per dispatch
    assert seen_many.starts == seen_one.starts
    assert [e[:2] for e in seen_many.ends] == [e[:2] for e in seen_one.ends]
    assert {e[2] for e in seen_one.ends} == {0}
    assert max(e[2] for e in seen_many.ends) == k - 1  # a whole group's first batch


def test_a_dispatch_ends_at_checkpoint_steps_and_resumes_bitwise(tmp_path):
    straight, _, _ = _fit(tmp_path / "a", 1, True)
    ckpt = jl.ModelCheckpoint(
        tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, async_save=False
    )
    _, seen, _ = _fit(tmp_path / "b", 4, True, callbacks=[ckpt], max_steps=15)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [
        "10",
        "15",
        "5",
    ]
    # the checkpoint of step 10 holds the state of step 10: resumed, the run
    # ends bitwise where the uninterrupted one did
    resumed, _, _ = _fit(tmp_path / "c", 4, True, ckpt_path=str(tmp_path / "ckpt" / "10"))
    assert resumed.global_step == straight.global_step == 26
    assert _same_params(straight, resumed)


def test_a_checkpoint_mid_dispatch_is_refused_with_what_to_do(tmp_path):
    ckpt = jl.ModelCheckpoint(tmp_path / "ckpt", async_save=False)

    class SaveEachBatch(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            ckpt.save(trainer, module)  # a callback saving at every batch

    with pytest.raises(RuntimeError, match=r"3 step\(s\) ahead.*steps_ahead == 0"):
        _fit(tmp_path, 4, True, callbacks=[ckpt, SaveEachBatch()])


@pytest.mark.parametrize("bad, match", [(0, "steps_per_execution"), ("8", "steps_per_execution")])
def test_bad_steps_per_execution_is_named(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jl.Trainer(steps_per_execution=bad, logger=False)


def test_pmap_refuses_several_steps_per_dispatch():
    with pytest.raises(ValueError, match="steps_per_execution=4 needs .*'pmap'"):
        jl.Trainer(strategy="pmap", steps_per_execution=4, logger=False)


class EpochsOnly(jl.Callback):
    """A callback with epoch hooks only: nothing that needs each step."""

    def __init__(self):
        self.epochs = 0

    def on_train_epoch_end(self, trainer, module):
        self.epochs += 1


def test_the_auto_default_groups_steps_and_trains_bitwise_as_one_step_per_dispatch():
    # "auto" (the default) groups 8 steps where no one can tell: the same
    # parameters as one step per dispatch; a callback with a batch hook (Seen)
    # makes it run one step per dispatch.
    def fit(**kwargs):
        trainer = quiet_trainer(max_epochs=2, callbacks=[EpochsOnly()], **kwargs)
        trainer.fit(LitMLP(init_variables=init_mlp(), dropout=0.1), _train_loader())
        return trainer

    auto, one = fit(), fit(steps_per_execution=1)
    assert jl.TrainerArgs().steps_per_execution == "auto"
    assert (auto.steps_per_dispatch, one.steps_per_dispatch) == (8, 1)
    assert auto.global_step == one.global_step == 26
    assert _same_params(auto, one)
    watched = quiet_trainer(max_epochs=1, callbacks=[Seen()])
    watched.fit(LitMLP(init_variables=init_mlp()), _train_loader())
    assert watched.steps_per_dispatch == 1
