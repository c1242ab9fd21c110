"""ReduceLROnPlateau from configure_optimizers' Lightning dict: a traced scale
of the updates, stepped after each epoch by the monitored metric."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import torch

import jaxlightning as jl
from tests.helpers import LitMLP, digits, init_mlp, loader, quiet_trainer


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"mode": "max", "patience": 1, "cooldown": 2},
        {"patience": 0, "threshold": 0.05, "threshold_mode": "abs", "factor": 0.5},
    ],
)
def test_the_rule_is_torchs(settings):
    rng = np.random.default_rng(0)
    values = np.cumsum(rng.normal(0, 1, 60)) * 0.1 + 5  # a wandering metric with plateaus
    ours = jl.ReduceLROnPlateau(**{"patience": 3, **settings})
    param = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([param], lr=1.0)
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd, **{"patience": 3, **settings})
    for value in values:
        theirs.step(float(value))
        assert ours.step(float(value)) == pytest.approx(sgd.param_groups[0]["lr"], rel=1e-12)
    assert ours.scale < 1.0  # it did lower


class PlateauMLP(LitMLP):
    def configure_optimizers(self):
        scheduler = jl.ReduceLROnPlateau(mode="max", patience=0, factor=0.5, threshold=0.5)
        return {
            "optimizer": optax.sgd(0.05),
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val/acc"},
        }


class Recorder(jl.Callback):
    def __init__(self):
        self.values, self.steps = [], []

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.values.append(trainer.callback_metrics["val/acc"])
            self.steps.append(trainer.global_step)


def test_the_scale_is_traced_and_equals_a_schedule_of_the_same_steps(compiles):
    x, y = digits(256)
    recorder = Recorder()
    compiles.reset()
    trainer = quiet_trainer(max_epochs=4, devices=2, callbacks=[recorder])
    trainer.fit(PlateauMLP(init_variables=init_mlp()), loader(x, y, 32), loader(x, y, 128))
    assert compiles.matching("train_step") == 1  # the scale changed without a recompile

    # The same rule on the recorded values gives the scale of each epoch ...
    rule, scales = jl.ReduceLROnPlateau(mode="max", patience=0, factor=0.5, threshold=0.5), [1.0]
    for value in recorder.values[:-1]:
        scales.append(rule.step(value))
    assert min(scales) < 1.0
    # ... and SGD scaled by them as an optax schedule of the update count trains
    # to the same parameters.
    per_epoch = recorder.steps[0]
    factors = {e * per_epoch: s for e, s in enumerate(scales)}

    class Scheduled(LitMLP):
        def configure_optimizers(self):
            return optax.chain(
                optax.sgd(0.05),
                optax.scale_by_schedule(optax.piecewise_constant_schedule(1.0, {
                    k: factors[k] / factors[k - per_epoch] for k in list(factors)[1:]
                })),
            )  # fmt: skip

    reference = quiet_trainer(max_epochs=4, devices=2)
    reference.fit(Scheduled(init_variables=init_mlp()), loader(x, y, 32))
    ours, theirs = jax.tree.leaves(trainer.state.params), jax.tree.leaves(reference.state.params)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_the_learning_rate_monitor_shows_the_rate_a_plateau_lowered(tmp_path):
    # Lightning's LearningRateMonitor reads the group's lr, which torch's
    # ReduceLROnPlateau lowers; it logged the optimizer's base rate (issue 61)
    class Injected(PlateauMLP):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            return {**config, "optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)}

    class Scales(jl.Callback):  # the plateau's scale when each epoch starts
        def __init__(self):
            self.seen = []

        def on_train_epoch_start(self, trainer, module):
            stepper = next(c for c in trainer.callbacks if hasattr(c, "scheduler"))
            self.seen.append(stepper.scheduler.scale)

    x, y = digits(256)
    monitor, scales = jl.LearningRateMonitor(logging_interval="epoch"), Scales()
    trainer = quiet_trainer(
        max_epochs=4, devices=2, callbacks=[monitor, scales], logger=jl.CSVLogger(str(tmp_path))
    )
    trainer.fit(Injected(init_variables=init_mlp()), loader(x, y, 32), loader(x, y, 128))
    (rates,) = monitor.lrs.values()
    assert min(scales.seen) < 1.0  # a plateau lowered it
    assert rates == pytest.approx([0.05 * s for s in scales.seen])


def test_a_resumed_run_keeps_the_scale_and_the_rules_counters(tmp_path):
    x, y = digits(256)

    whole = quiet_trainer(max_epochs=4, devices=2)
    whole.fit(PlateauMLP(init_variables=init_mlp()), loader(x, y, 32), loader(x, y, 128))
    ckpt = jl.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    first = quiet_trainer(max_epochs=2, devices=2, callbacks=[ckpt])
    first.fit(PlateauMLP(init_variables=init_mlp()), loader(x, y, 32), loader(x, y, 128))
    second = quiet_trainer(max_epochs=4, devices=2)
    second.fit(
        PlateauMLP(init_variables=init_mlp()), loader(x, y, 32), loader(x, y, 128),
        ckpt_path=ckpt.last_model_path or ckpt.best_model_path,
    )  # fmt: skip
    ours, theirs = jax.tree.leaves(second.state.params), jax.tree.leaves(whole.state.params)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_plateau_needs_its_metric_and_the_dict_form_is_checked():
    x, y = digits(64)
    with pytest.raises(RuntimeError, match="conditioned on 'val/acc', which is not available"):
        quiet_trainer(max_epochs=1).fit(PlateauMLP(), loader(x, y, 32))

    class Cosine(LitMLP):
        def configure_optimizers(self):
            return {"optimizer": optax.sgd(0.1), "lr_scheduler": optax.cosine_decay_schedule(1, 9)}

    with pytest.raises(TypeError, match="give the optimizer an optax schedule"):
        quiet_trainer(max_epochs=1).fit(Cosine(), loader(x, y, 32))
