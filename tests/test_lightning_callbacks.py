"""Lightning's EarlyStopping and LearningRateMonitor tests, translated.

Each test names the Lightning test it translates (in Lightning's
``tests/tests_pytorch/callbacks/``) and keeps its expected values. Lightning's
models log a scripted value per epoch from a host-side hook; `Scripted` does
the same on a tiny MLP, with one-batch epochs unless a test needs more.
"""

from __future__ import annotations

import json
import math

import numpy as np
import optax
import pytest

import jaxlightning as jl
from jaxlightning.callbacks.early_stopping import EarlyStoppingReason
from tests.helpers import LitMLP, digits, lightning_trainer, loader

X, Y = digits(16)


def one_batch():
    """16 rows in one batch: one step per epoch, one validation batch."""
    return loader(X, Y, 16)


def batches(n: int, size: int = 8):
    """``n`` batches of ``size`` rows."""
    x, y = digits(n * size)
    return loader(x, y, size)


class Scripted(LitMLP):
    """Logs ``name = values[current_epoch]`` for each entry of ``script`` from its
    ``on_validation_epoch_end``, or with ``on_train`` its ``on_train_epoch_end``."""

    def __init__(self, script: dict[str, list[float]], on_train: bool = False):
        super().__init__(hidden=8)
        self.script, self.on_train = script, on_train

    def _log_script(self) -> None:
        for name, values in self.script.items():
            self.log(name, float(values[self.current_epoch]))

    def on_validation_epoch_end(self) -> None:
        if not self.on_train:
            self._log_script()

    def on_train_epoch_end(self) -> None:
        if self.on_train:
            self._log_script()


class CountingStopper(jl.EarlyStopping):
    """Counts its checks (each value it judges)."""

    checks = 0

    def decide(self, value: float) -> str:
        self.checks += 1
        return super().decide(value)


# ------------------------------------------------------------ EarlyStopping


# Lightning: test_early_stopping.py::test_early_stopping_state_key
def test_state_key_names_the_monitor_and_mode():
    stopper = jl.EarlyStopping(monitor="val_loss")
    assert stopper.state_key == "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"


# Lightning: test_early_stopping.py::test_early_stopping_mode_options
def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="`mode` can be .* got unknown_option"):
        jl.EarlyStopping(monitor="foo", mode="unknown_option")


PATIENCE_CASES = [
    ([6, 5, 5, 5, 5, 5], 3, 4),
    ([6, 5, 4, 4, 3, 3], 1, 3),
    ([6, 5, 6, 5, 5, 5], 3, 4),
]


# Lightning: test_early_stopping.py::test_early_stopping_patience
@pytest.mark.parametrize(("loss_values", "patience", "expected_stop_epoch"), PATIENCE_CASES)
def test_patience_counts_checks_after_validation(loss_values, patience, expected_stop_epoch):
    stopper = jl.EarlyStopping(monitor="test_val_loss", patience=patience)
    trainer = lightning_trainer(max_epochs=10, num_sanity_val_steps=0, callbacks=[stopper])
    trainer.fit(Scripted({"test_val_loss": loss_values}), one_batch(), one_batch())
    assert trainer.current_epoch - 1 == expected_stop_epoch
    assert stopper.stopped_epoch == expected_stop_epoch


# Lightning: test_early_stopping.py::test_early_stopping_patience_train and
# ::test_early_stopping_no_val_step. The value is logged in the module's
# on_train_epoch_end: the check at that epoch's end sees it. Without validation
# the default (check_on_train_epoch_end=None) checks there too.
@pytest.mark.parametrize(
    ("loss_values", "patience", "expected_stop_epoch", "validation"),
    [*((*case, False) for case in PATIENCE_CASES), (*PATIENCE_CASES[0], True)],
)
def test_patience_counts_checks_at_train_epoch_ends(
    loss_values, patience, expected_stop_epoch, validation
):
    flag = True if validation else None
    stopper = jl.EarlyStopping("train_loss", patience=patience, check_on_train_epoch_end=flag)
    trainer = lightning_trainer(max_epochs=10, num_sanity_val_steps=0, callbacks=[stopper])
    val = one_batch() if validation else None
    trainer.fit(Scripted({"train_loss": loss_values}, on_train=True), one_batch(), val)
    assert trainer.current_epoch - 1 == expected_stop_epoch
    assert stopper.stopped_epoch == expected_stop_epoch


# Lightning: test_early_stopping.py::test_early_stopping_thresholds
@pytest.mark.parametrize(
    ("stopping_threshold", "divergence_threshold", "losses", "expected_epoch"),
    [
        (None, None, [8, 4, 2, 3, 4, 5, 8, 10], 5),
        (2.9, None, [9, 8, 7, 6, 5, 6, 4, 3, 2, 1], 8),
        (None, 15.9, [9, 4, 2, 16, 32, 64], 3),
    ],
)
def test_thresholds_stop_at_once(stopping_threshold, divergence_threshold, losses, expected_epoch):
    stopper = jl.EarlyStopping(
        monitor="abc",
        stopping_threshold=stopping_threshold,
        divergence_threshold=divergence_threshold,
    )
    trainer = lightning_trainer(max_epochs=20, callbacks=[stopper])
    trainer.fit(Scripted({"abc": losses}), one_batch(), one_batch())
    assert trainer.current_epoch - 1 == expected_epoch


# Lightning: test_early_stopping.py::test_early_stopping_on_non_finite_monitor
@pytest.mark.parametrize("stop_value", [math.inf, math.nan])
def test_a_non_finite_value_stops(stop_value):
    stopper = jl.EarlyStopping(monitor="val_loss", check_finite=True)
    trainer = lightning_trainer(max_epochs=10, callbacks=[stopper])
    trainer.fit(Scripted({"val_loss": [4, 3, stop_value, 2, 1]}), one_batch(), one_batch())
    assert trainer.current_epoch - 1 == 2
    assert stopper.stopped_epoch == 2
    assert stopper.stopping_reason is EarlyStoppingReason.NON_FINITE_METRIC
    assert "is not finite" in stopper.stopping_reason_message


# Lightning: test_early_stopping.py::test_min_epochs_min_steps_global_step. Lightning
# forces a stop at every check with a mock; here a stopping threshold of +inf does.
@pytest.mark.parametrize(
    ("limit_train_batches", "min_epochs", "min_steps", "stop_step"),
    [
        (3, 0, 10, 10),
        (5, 0, 10, 10),
        (3, 2, 0, 6),
        (5, 2, 0, 10),
        (3, 1, 10, 10),
        (5, 1, 10, 10),
        (3, 3, 10, 10),
        (5, 3, 10, 15),
    ],
)
def test_a_stop_waits_for_min_epochs_and_min_steps(
    limit_train_batches, min_epochs, min_steps, stop_step
):
    stopper = jl.EarlyStopping("acc", stopping_threshold=math.inf)
    trainer = lightning_trainer(
        max_epochs=10,
        limit_train_batches=limit_train_batches,
        min_epochs=min_epochs,
        min_steps=min_steps,
        callbacks=[stopper],
    )
    trainer.fit(LitMLP(hidden=8), batches(5))
    expected_epochs = max(math.ceil(min_steps / limit_train_batches), min_epochs)
    assert trainer.should_stop
    assert trainer.current_epoch == expected_epochs  # epochs go on until min_steps...
    assert trainer.global_step == stop_step  # ...and stop there, mid-epoch if need be
    assert stopper.stopping_reason is EarlyStoppingReason.STOPPING_THRESHOLD


TWO_SCORES = {"abc": [8, 4, 2, 3, 4, 5, 8, 10], "cba": [0] * 8}


# Lightning: test_early_stopping.py::test_multiple_early_stopping_callbacks (one
# process). `cba` never improves after epoch 0: with patience 3 it stops after
# epoch 3, before `abc` would (epoch 5). Each one's state is in the checkpoint.
@pytest.mark.parametrize("first", ["abc", "cba"])
@pytest.mark.parametrize("on_train", [False, True])
def test_several_early_stoppings_any_one_stops(first, on_train):
    flag = {"check_on_train_epoch_end": True} if on_train else {}
    by_monitor = {
        "abc": jl.EarlyStopping("abc", **flag),
        "cba": jl.EarlyStopping("cba", patience=3, **flag),
    }
    callbacks = sorted(by_monitor.values(), key=lambda c: c.monitor != first)
    trainer = lightning_trainer(max_epochs=20, callbacks=callbacks)
    model = Scripted(TWO_SCORES, on_train=on_train)
    trainer.fit(model, one_batch(), one_batch())
    assert trainer.current_epoch - 1 == 3
    assert by_monitor["cba"].stopping_reason is EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert by_monitor["abc"].stopping_reason is EarlyStoppingReason.NOT_STOPPED
    _, record = trainer.checkpoint_payload(model)
    saved = [state for key, state in record["callbacks"].items() if key.startswith("EarlyStopping")]
    assert sorted(saved, key=lambda s: s["best_score"]) == [
        by_monitor["cba"].state_dict(),  # best 0, waited 3, stopped
        by_monitor["abc"].state_dict(),  # best 2, waited 1
    ]
    assert by_monitor["abc"].state_dict()["best_score"] == 2.0


class RestoredState(jl.EarlyStopping):
    """Records the state it starts training with."""

    def on_train_start(self, trainer, module):
        self.restored = self.state_dict()


# Lightning: EarlyStopping's state_key ("saving and restoring multiple early stopping
# callbacks at the same time is supported under variation in monitor, mode") and
# test_early_stopping.py::test_resume_early_stopping_from_checkpoint.
def test_each_early_stopping_gets_its_own_state_back_in_any_order(tmp_path):
    first = [RestoredState("abc"), RestoredState("cba", patience=3)]
    trainer = lightning_trainer(
        max_epochs=2, default_root_dir=tmp_path, enable_checkpointing=True, callbacks=first
    )
    trainer.fit(Scripted(TWO_SCORES), one_batch(), one_batch())
    again = [RestoredState("cba", patience=3), RestoredState("abc")]  # the other order
    resumed = lightning_trainer(
        max_epochs=3, default_root_dir=tmp_path, enable_checkpointing=True, callbacks=again
    )
    resumed.fit(Scripted(TWO_SCORES), one_batch(), one_batch(), ckpt_path="last")
    assert again[0].restored == first[1].state_dict()
    assert again[1].restored == first[0].state_dict()


class LogsFoo(LitMLP):
    """Logs ``foo = 1`` in every validation step (``foo``, as logged)."""

    def eval_step(self, variables, batch):
        super().eval_step(variables, batch)
        self.log("foo", 1.0)


# Lightning: test_early_stopping.py::test_check_on_train_epoch_end_smart_handling. With
# validation other than once per epoch it checks after each validation. Lightning
# mocks the criteria as (go on, stop); patience 1 on a constant value does that.
def test_with_other_validation_schedules_it_checks_after_validations():
    stopper = CountingStopper(monitor="foo", patience=1)
    trainer = lightning_trainer(
        val_check_interval=0.3,
        limit_train_batches=10,
        limit_val_batches=1,
        max_epochs=10,
        callbacks=[stopper],
    )
    trainer.fit(LogsFoo(hidden=8), batches(10, 4), one_batch())
    assert stopper.checks == 2
    assert trainer.global_step == 2 * int(10 * 0.3)  # limit_train_batches * val_check_interval

    stopper = CountingStopper(monitor="foo", patience=1)
    trainer = lightning_trainer(
        check_val_every_n_epoch=2, limit_val_batches=1, max_epochs=5, callbacks=[stopper]
    )
    trainer.fit(LogsFoo(hidden=8), one_batch(), one_batch())
    assert stopper.checks == 2
    assert trainer.current_epoch == 2 * 2


# Lightning: EarlyStopping._validate_condition_metric (a RuntimeError naming the
# metric and the available ones). Here a validation value the sanity check did
# not log is refused before any training; other names at the first check.
def test_a_monitor_never_logged_is_named_before_training_when_it_can_be():
    trainer = lightning_trainer(max_epochs=2, callbacks=[jl.EarlyStopping("val/nope")])
    with pytest.raises(RuntimeError, match=r"`val/nope` which is not available.*`loss`") as err:
        trainer.fit(LitMLP(hidden=8), one_batch(), one_batch())
    assert "sanity check" in str(err.value)
    assert trainer.global_step == 0

    # a name training hooks could log is only known missing at the first check
    trainer = lightning_trainer(max_epochs=2, callbacks=[jl.EarlyStopping("nope")])
    with pytest.raises(RuntimeError, match="`nope` which is not available"):
        trainer.fit(LitMLP(hidden=8), one_batch(), one_batch())
    assert trainer.global_step == 1


# Lightning: test_early_stopping.py::test_early_stopping_reasons (fitted cases)
@pytest.mark.parametrize(
    ("losses", "kwargs", "max_epochs", "reason", "message"),
    [
        ([10.0] * 10, {"patience": 2}, 10, "PATIENCE_EXHAUSTED", "did not improve"),
        (
            [5.0, 3.0, 1.0, 0.5] + [0.1] * 6,
            {"stopping_threshold": 0.6},
            10,
            "STOPPING_THRESHOLD",
            "Stopping threshold reached",
        ),
        (
            [1.0, 2.0, 5.0, 10.0] + [15.0] * 6,
            {"divergence_threshold": 8.0},
            10,
            "DIVERGENCE_THRESHOLD",
            "Divergence threshold reached",
        ),
        ([5.0, 4.0, 3.0], {"patience": 3}, 3, "NOT_STOPPED", None),
    ],
)
def test_stopping_reasons(losses, kwargs, max_epochs, reason, message):
    stopper = jl.EarlyStopping(monitor="val_loss", verbose=True, **kwargs)
    trainer = lightning_trainer(max_epochs=max_epochs, callbacks=[stopper])
    trainer.fit(Scripted({"val_loss": losses}), one_batch(), one_batch())
    assert stopper.stopping_reason is EarlyStoppingReason[reason]
    if message is None:
        assert stopper.stopping_reason_message is None and stopper.stopped_epoch == 0
    else:
        assert message in stopper.stopping_reason_message and stopper.stopped_epoch > 0


# Lightning: test_early_stopping.py::test_early_stopping_reasons (state persistence and
# backward compatibility); records pass through JSON in checkpoints here.
def test_stopping_reasons_survive_a_checkpoint_record_and_old_records_load():
    stopper = jl.EarlyStopping(monitor="val_loss", patience=3)
    stopper.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
    stopper.stopping_reason_message = "Test message"
    restored = jl.EarlyStopping(monitor="val_loss", patience=3)
    restored.load_state_dict(json.loads(json.dumps(stopper.state_dict())))
    assert restored.stopping_reason is EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert restored.stopping_reason_message == "Test message"

    old = jl.EarlyStopping(monitor="val_loss", patience=3)
    old.load_state_dict({"wait_count": 2, "stopped_epoch": 5, "best_score": 0.5, "patience": 3})
    assert old.stopping_reason is EarlyStoppingReason.NOT_STOPPED
    assert old.stopping_reason_message is None
    assert (old.wait_count, old.stopped_epoch, old.best_score) == (2, 5, 0.5)


# ------------------------------------------------------- LearningRateMonitor


class Recorder(jl.Logger):
    """Keeps every logged value: ``points[name][step]``."""

    log_dir = ""

    def __init__(self):
        self.points: dict[str, dict[int, float]] = {}

    def log_hyperparams(self, params):
        pass

    def log_metrics(self, metrics, step):
        for name, value in metrics.items():
            self.points.setdefault(name, {})[step] = value


class Optimized(LitMLP):
    """`LitMLP` with the optimizer ``make()`` returns."""

    def __init__(self, make):
        super().__init__(hidden=8)
        self.make = make

    def configure_optimizers(self):
        return self.make()


def sgd_float64():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=np.float64(0.01), momentum=0.9)


@pytest.fixture(scope="module")
def sgd_run():
    """One fit (2 epochs of 7 steps, ``log_every_n_steps=2``) of SGD with momentum
    0.9 at a float64 rate of 0.01, watched by monitors of every kind."""
    monitors = {
        "default": jl.LearningRateMonitor(),
        "prefixed": jl.LearningRateMonitor(log_key_prefix="optim/"),
        "named": jl.LearningRateMonitor(name="my_logging_name"),
        "by_step": jl.LearningRateMonitor(logging_interval="step", log_key_prefix="step/"),
        "by_epoch": jl.LearningRateMonitor(logging_interval="epoch", log_key_prefix="epoch/"),
        "momentum": jl.LearningRateMonitor(
            log_momentum=True, log_weight_decay=True, log_key_prefix="train/"
        ),
    }
    logger = Recorder()
    trainer = lightning_trainer(
        max_epochs=2, log_every_n_steps=2, logger=logger, callbacks=list(monitors.values())
    )
    trainer.fit(Optimized(sgd_float64), batches(7))
    return trainer, monitors, logger


# Lightning: test_lr_monitor.py::test_lr_monitor_single_lr,
# ::test_lr_monitor_no_lr_scheduler_single_lr and ::test_lr_monitor_log_key_prefix_none
def test_the_key_is_lr_and_the_optimizer_name(sgd_run):
    _, monitors, logger = sgd_run
    default = monitors["default"]
    assert default.lrs, "No learning rates logged"
    assert list(default.lrs) == ["lr-SGD"]
    assert all(v is None for v in default.last_momentum_values.values())
    assert all(v is None for v in default.last_weight_decay_values.values())
    assert all(v == pytest.approx(0.01) for v in logger.points["lr-SGD"].values())


# Lightning: test_lr_monitor.py::test_lr_monitor_with_float64_lr
def test_a_float64_rate_is_logged(sgd_run):
    trainer, monitors, _ = sgd_run
    assert monitors["default"].lrs["lr-SGD"][0] == pytest.approx(0.01)
    assert isinstance(trainer.callback_metrics["lr-SGD"], float)


# Lightning: test_lr_monitor.py::test_lr_monitor_log_key_prefix and ::test_lr_monitor_custom_name
def test_a_prefix_or_a_name_sets_the_key(sgd_run):
    trainer, monitors, logger = sgd_run
    assert list(monitors["prefixed"].lrs) == ["optim/lr-SGD"]
    assert "optim/lr-SGD" in trainer.callback_metrics and "optim/lr-SGD" in logger.points
    assert list(monitors["named"].lrs) == ["my_logging_name"]


# Lightning: test_lr_monitor.py::test_lr_monitor_no_lr_scheduler_multi_lrs (counts). By
# step it logs before every log_every_n_steps-th update, at the step it follows; by
# epoch when each epoch starts, from the first. Lightning's default (no scheduler:
# both) logs at both.
def test_it_logs_from_the_first_step_or_epoch(sgd_run):
    trainer, monitors, logger = sgd_run
    assert trainer.global_step == 14
    assert len(monitors["by_step"].lrs["step/lr-SGD"]) == 14 // 2
    assert sorted(logger.points["step/lr-SGD"]) == [1, 3, 5, 7, 9, 11, 13]
    assert len(monitors["by_epoch"].lrs["epoch/lr-SGD"]) == trainer.max_epochs
    assert sorted(logger.points["epoch/lr-SGD"]) == [0, 7]
    assert len(monitors["default"].lrs["lr-SGD"]) == 14 // 2 + 2
    assert sorted(logger.points["lr-SGD"]) == [0, 1, 3, 5, 7, 9, 11, 13]


# Lightning: test_lr_monitor.py::test_lr_monitor_single_lr_with_momentum (SGD),
# ::test_lr_monitor_no_lr_scheduler_single_lr_with_momentum (SGD) and
# ::test_lr_monitor_log_key_prefix_with_momentum_and_weight_decay
def test_momentum_and_weight_decay(sgd_run):
    _, monitors, logger = sgd_run
    monitor = monitors["momentum"]
    assert list(monitor.lrs) == ["train/lr-SGD"]
    assert monitor.last_momentum_values == {"train/lr-SGD-momentum": pytest.approx(0.9)}
    # optax.sgd injects no weight decay: 0, as torch's SGD default
    assert monitor.last_weight_decay_values == {"train/lr-SGD-weight_decay": 0.0}
    assert all(v == pytest.approx(0.9) for v in logger.points["train/lr-SGD-momentum"].values())


# Lightning: test_lr_monitor.py::test_lr_monitor_multi_optimizers (two Adams:
# "lr-Adam", "lr-Adam-1") and ::test_lr_monitor_log_key_prefix_multi_optimizers
# (["hparams/lr-Adam", "hparams/lr-SGD"]). A dict of optimizers is several
# optimizers: named by kind, the second of a kind with "-1", in the dict's order.
def test_several_optimizers_are_named_as_lightning_names_them():
    lr, momentum, weight_decay = 1e-2, 0.7, 0.1
    rates = {"Dense_0": lr * 0.1, "Dense_1": lr, "Dense_2": lr * 0.5}
    sgd = optax.inject_hyperparams(optax.sgd)

    def groups():
        adamw = optax.inject_hyperparams(optax.adamw)
        decay = {"b1": momentum, "weight_decay": weight_decay}
        return {
            "Dense_0": adamw(learning_rate=rates["Dense_0"], **decay),
            "Dense_1": sgd(learning_rate=rates["Dense_1"], momentum=momentum),
            "Dense_2": adamw(learning_rate=rates["Dense_2"], **decay),
        }

    monitor = jl.LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    prefixed = jl.LearningRateMonitor(log_key_prefix="hparams/")
    trainer = lightning_trainer(
        max_epochs=2, logger=Recorder(), limit_train_batches=2, callbacks=[monitor, prefixed]
    )
    trainer.fit(Optimized(groups), batches(2))
    keys = ["lr-AdamW", "lr-SGD", "lr-AdamW-1"]
    assert list(monitor.lrs) == keys
    assert list(monitor.last_momentum_values) == [f"{k}-momentum" for k in keys]
    assert all(v == pytest.approx(momentum) for v in monitor.last_momentum_values.values())
    assert list(monitor.last_weight_decay_values) == [f"{k}-weight_decay" for k in keys]
    decays = monitor.last_weight_decay_values
    assert decays == {
        "lr-AdamW-weight_decay": pytest.approx(weight_decay),
        "lr-SGD-weight_decay": 0.0,
        "lr-AdamW-1-weight_decay": pytest.approx(weight_decay),
    }
    for key, rate in zip(keys, rates.values(), strict=True):
        assert monitor.lrs[key] == [pytest.approx(rate)] * 2
    assert list(prefixed.lrs) == [f"hparams/{k}" for k in keys]


# Lightning: test_lr_monitor.py::test_log_momentum_no_momentum_optimizer(_no_lr_scheduler)
def test_log_momentum_without_momentum_warns_and_logs_zero():
    monitor = jl.LearningRateMonitor(log_momentum=True)
    adagrad = optax.inject_hyperparams(optax.adagrad)
    trainer = lightning_trainer(
        max_steps=2, log_every_n_steps=1, logger=Recorder(), callbacks=[monitor]
    )
    with pytest.warns(RuntimeWarning, match="optimizers do not have momentum"):
        trainer.fit(Optimized(lambda: adagrad(learning_rate=1e-2)), batches(2))
    assert monitor.last_momentum_values == {"lr-Adagrad-momentum": 0.0}


# Lightning: test_lr_monitor.py::test_lr_monitor_update_callback_metrics. StepLR
# halving the rate each epoch is a staircase schedule of 2 steps here; Lightning
# logs a scheduler stepped per epoch when each epoch starts.
def test_the_rate_is_in_callback_metrics_for_early_stopping():
    schedule = optax.exponential_decay(0.1, transition_steps=2, decay_rate=0.5, staircase=True)
    monitor = jl.LearningRateMonitor(logging_interval="epoch")
    stopper = jl.EarlyStopping(
        monitor="lr-SGD", mode="min", stopping_threshold=0.02, check_on_train_epoch_end=True
    )
    trainer = lightning_trainer(max_epochs=5, logger=Recorder(), callbacks=[monitor, stopper])
    sgd = optax.inject_hyperparams(optax.sgd)
    trainer.fit(Optimized(lambda: sgd(learning_rate=schedule)), batches(2))
    assert "lr-SGD" in trainer.callback_metrics
    assert monitor.lrs["lr-SGD"] == pytest.approx([0.1, 0.05, 0.025, 0.0125])
    assert trainer.current_epoch - 1 == 3
    assert stopper.stopped_epoch == 3


def test_a_scheduled_rate_is_the_next_updates():
    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=16)
    injected, by_schedule = (
        jl.LearningRateMonitor(),
        jl.LearningRateMonitor(schedule=schedule, name="lr"),
    )
    logger = Recorder()
    trainer = lightning_trainer(
        max_epochs=2, log_every_n_steps=4, logger=logger, callbacks=[injected, by_schedule]
    )
    sgd = optax.inject_hyperparams(optax.sgd)
    trainer.fit(Optimized(lambda: sgd(learning_rate=schedule)), batches(8))
    # before updates 4, 8, 12 and 16, at the step before each (a schedule: not at epoch starts)
    expected = {s: pytest.approx(float(schedule(s))) for s in (3, 7, 11, 15)}
    assert logger.points["lr-SGD"] == expected
    assert logger.points["lr"] == expected


# Lightning: test_lr_monitor.py::test_lr_monitor_no_logger
def test_without_a_logger_it_refuses_to_start():
    trainer = lightning_trainer(max_epochs=1, callbacks=[jl.LearningRateMonitor()])
    with pytest.raises(ValueError, match="Trainer that has no logger"):
        trainer.fit(Optimized(sgd_float64), one_batch())
    assert trainer.global_step == 0


class SanityCheckSeen(jl.Callback):
    seen = False

    def on_sanity_check_start(self, trainer, module):
        self.seen = True


def test_an_optimizer_without_an_injected_rate_is_refused_at_fit_start():
    seen = SanityCheckSeen()
    trainer = lightning_trainer(
        max_epochs=2, logger=Recorder(), callbacks=[jl.LearningRateMonitor(), seen]
    )
    with pytest.raises(ValueError, match=r"optax\.inject_hyperparams\(optax\.adam\)"):
        trainer.fit(LitMLP(hidden=8), one_batch(), one_batch())
    assert trainer.global_step == 0 and not seen.seen


# Lightning: trainer/connectors/test_callback_connector.py::test_attach_model_callbacks
# (GradientAccumulationScheduler, which jaxlightning has not, left out).
def test_the_modules_callbacks_replace_those_of_their_type():
    from jaxlightning.loop.hooks import Hooks

    def attach(trainer_callbacks, model_callbacks):
        class Module(LitMLP):
            def configure_callbacks(self):
                return model_callbacks

        hooks = Hooks(list(trainer_callbacks), view=None)
        hooks.attach_module_callbacks(Module())
        return hooks.callbacks

    early_stopping = jl.EarlyStopping(monitor="foo")
    progress_bar = jl.callbacks.TQDMProgressBar()
    lr_monitor = jl.LearningRateMonitor()
    assert attach([], []) == []
    assert attach([early_stopping], [progress_bar]) == [early_stopping, progress_bar]
    assert attach([progress_bar, jl.EarlyStopping(monitor="foo")], [early_stopping]) == [
        progress_bar,
        early_stopping,
    ]
    several = [jl.LearningRateMonitor(), jl.EarlyStopping(monitor="foo")] * 2
    assert attach(several, [early_stopping, lr_monitor]) == [early_stopping, lr_monitor]
    both = [jl.LearningRateMonitor(), progress_bar, jl.EarlyStopping(monitor="foo")]
    assert attach(both, [early_stopping, lr_monitor, early_stopping]) == [
        progress_bar,
        early_stopping,
        lr_monitor,
        early_stopping,
    ]
    checkpoint = jl.ModelCheckpoint()
    assert attach([checkpoint, progress_bar], [lr_monitor]) == [
        progress_bar,
        lr_monitor,
        checkpoint,
    ]


class Counting(jl.Callback):
    def __init__(self):
        self.epochs = 0

    def on_train_epoch_end(self, trainer, module):
        self.epochs += 1


def test_a_fit_runs_the_callbacks_the_module_configures():
    counting = Counting()

    class WithCallbacks(LitMLP):
        def configure_callbacks(self):
            return counting  # one callback, not a list, as Lightning allows

    trainer = lightning_trainer(max_epochs=2)
    trainer.fit(WithCallbacks(hidden=8), batches(3))
    assert counting.epochs == 2 and counting in trainer.callbacks
