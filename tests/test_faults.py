"""Field-test failures: no process aborts, clear errors for what users get wrong."""

import logging
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import jaxlightning as jl
from jaxlightning import checks
from jaxlightning.programs import compiled as startup_module
from jaxlightning.xla import compiling
from tests.helpers import (
    LitMLP,
    assert_bitwise_equal,
    digits,
    init_mlp,
    loader,
    max_abs_diff,
    np_logits,
    quiet_trainer,
)

ROOT = Path(__file__).resolve().parents[1]

# case -> (exit status, text the output must hold)
FAULTS = {
    "log-shape": (1, "self.log('logits', ...) got an array of shape (2, 10)"),
    "log-keyword": (1, "log() got an unexpected keyword argument 'bogus'"),
    "loss-dict": (1, "loss() returned a dict with keys ['acc', 'loss']; Lightning's"),
    "eval-bug": (1, "KeyError: 'eval_step looked up a missing key'"),
    "second-fit": (0, "fit: nothing left to do: max_epochs=1 reached"),
    "finished-resume": (0, "fit: nothing left to do: max_epochs=1 reached; the checkpoint"),
}


@pytest.mark.slow
def test_failing_and_finished_fits_end_cleanly_in_their_own_process(tmp_path):
    # Each case once aborted the process (exit 134, "terminate called after
    # throwing an instance of ''") from a compile thread left running.
    procs = {
        case: subprocess.Popen(
            [sys.executable, "-m", "tests.run_faults", case, str(tmp_path / case)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for case in FAULTS
    }
    for case, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        status, text = FAULTS[case]
        assert proc.returncode == status, f"{case}: exit {proc.returncode}\n{out}"
        assert text in out, f"{case}:\n{out}"
        assert "terminate called" not in out, f"{case}:\n{out}"
        steps = out.count("STEP")
        # The eval_step bug shows in the sanity check, before any training step.
        assert steps == {"eval-bug": 0, "log-shape": 0, "log-keyword": 0, "loss-dict": 0}.get(
            case, 4
        ), f"{case}: {steps} steps\n{out}"


def _jl_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("jl-") and t.is_alive()]


def test_no_compile_or_prefetch_thread_outlives_a_failed_fit():
    class BadLog(LitMLP):
        def loss(self, variables, batch, rngs):
            self.log("logits", self.net.apply(variables, batch[0]))
            return jnp.zeros(batch[0].shape[0])

    with pytest.raises(ValueError, match="got an array of shape"):
        quiet_trainer(max_steps=2).fit(BadLog(), loader(*digits(64), 16))
    assert _jl_threads() == []


def test_rejected_xla_option_is_dropped_and_init_is_unchanged(monkeypatch, caplog):
    # JAX 0.11 rejects xla_cpu_use_fusion_emitters; any private option may go.
    rejected = "xla_jl_test_option_that_does_not_exist"
    options = {**startup_module._RUN_ONCE_CPU_OPTIONS, rejected: True}
    monkeypatch.setattr(startup_module, "_RUN_ONCE_CPU_OPTIONS", options)
    x, y = digits(64)
    module = LitMLP()
    attempts = compiling.rejected_attempts()
    with caplog.at_level(logging.DEBUG, logger="jaxlightning.xla.compiling"):
        quiet_trainer(max_steps=0, seed=3).fit(module, loader(x, y, 64))
        quiet_trainer(max_steps=0, seed=3).fit(LitMLP(), loader(x, y, 64))
    assert rejected in caplog.text
    assert compiling.rejected_attempts() == attempts + 1  # not offered again
    init_rng = jax.random.split(jax.random.PRNGKey(3))[0]
    expected = jax.jit(module.setup)(init_rng, (x[:8], y[:8]))
    assert max_abs_diff(module.variables, expected) == 0.0


def test_progress_bar_keeps_metrics_at_the_start_of_each_epoch(tmp_path, capsys):
    x, y = digits(64)
    trainer = jl.Trainer(
        max_epochs=2,
        log_every_n_steps=100,
        logger=False,
        enable_checkpointing=False,
        log_loss=True,
    )
    trainer.fit(LitMLP(), loader(x, y, 16))
    frames = capsys.readouterr().err.replace("\n", "\r").split("\r")
    first_of_epoch_1 = next(f for f in frames if f.startswith("Epoch 1:") and " 0/4 " in f)
    assert "train/loss=" in first_of_epoch_1, first_of_epoch_1


def test_logging_the_trainers_own_name_in_loss_raises_and_loss_is_free():
    """Lightning code logs 'loss' in its training step: that works; only the
    name the Trainer reports the returned loss under (log_loss=True) is reserved."""

    def logs(name):
        class LogsLoss(LitMLP):
            def loss(self, variables, batch, rngs):
                per_example = super().loss(variables, batch, rngs)
                self.log(name, per_example)
                return per_example

        return LogsLoss()

    with pytest.raises(ValueError, match=r"self.log\('train/loss', ...\) in loss\(\)"):
        quiet_trainer(max_steps=1).fit(logs("train/loss"), loader(*digits(16), 8))
    trainer = jl.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        log_loss=True,
    )
    trainer.fit(logs("loss"), loader(*digits(16), 8))
    metrics = trainer.callback_metrics
    assert float(metrics["loss"]) == float(metrics["train/loss"])  # the same mean


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("high", r"self.log\('x', ...\) in loss\(\): `str` values cannot be logged"),
        (None, r"self.log\('x', ...\) in loss\(\): `NoneType` values cannot be logged"),
        ({"a": 1.0}, r"nested dictionaries cannot be logged; use self.log_dict"),
    ],
)
def test_logging_a_non_number_names_hook_and_type(value, message):
    class LogsValue(LitMLP):
        def loss(self, variables, batch, rngs):
            self.log("x", value)
            return super().loss(variables, batch, rngs)

    with pytest.raises(ValueError, match=message):  # Lightning's ValueError
        quiet_trainer(max_steps=1).fit(LogsValue(), loader(*digits(16), 8))


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("loss", r"loss\(\) returned a str; return a scalar or a per-example vector"),
        (None, r"loss\(\) returned a NoneType"),
        ([1.0, 2.0], r"loss\(\) returned a list"),
    ],
)
def test_loss_returning_a_non_array_names_type(returned, message):
    class Returns(LitMLP):
        def loss(self, variables, batch, rngs):
            return returned

    with pytest.raises(TypeError, match=message):
        quiet_trainer(max_steps=1).fit(Returns(), loader(*digits(16), 8))


def test_logged_names_that_change_between_traces_are_named():
    class Shifty(LitMLP):
        def loss(self, variables, batch, rngs):
            if batch[0].shape[0] == 1:  # true for the first batch's shape only
                self.log("first_only", 1.0)
            return super().loss(variables, batch, rngs)

    x, y = digits(24)
    batches = [(x[:8], y[:8]), (x[8:24], y[8:24])]  # the second is larger: traced again
    changed = r"loss\(\) logged \['acc', 'train/loss'\] in this trace but"
    with (
        pytest.raises(ValueError, match=changed),
        pytest.warns(UserWarning, match="larger than the fixed batch size"),
    ):
        quiet_trainer(max_epochs=1).fit(Shifty(), batches)


def test_setup_with_host_only_code_names_the_hook():
    class HostSetup(LitMLP):
        def setup(self, rng, batch):
            np.asarray(batch[0])  # a tracer: setup runs under jit
            return super().setup(rng, batch)

    with pytest.raises(TypeError, match=r"HostSetup.setup\(\) runs traced"):
        quiet_trainer(max_steps=1).fit(HostSetup(), loader(*digits(16), 8))


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (None, r"setup\(\) returned NoneType; return the flax variables dict"),
        ({"params": {"w": "zeros"}}, r"variables\['params'\]\['w'\] of type str"),
    ],
)
def test_setup_returning_non_variables_is_named(returned, message):
    class BadSetup(LitMLP):
        def setup(self, rng, batch):
            return returned

    with pytest.raises(TypeError, match=message):
        quiet_trainer(max_steps=1).fit(BadSetup(), loader(*digits(16), 8))


def test_multisteps_optimizer_is_accepted_and_equals_a_double_batch():
    class Accumulating(LitMLP):
        def configure_optimizers(self):
            return optax.MultiSteps(optax.sgd(0.5), every_k_schedule=2)

    class Plain(LitMLP):
        def configure_optimizers(self):
            return optax.sgd(0.5)

    from tests.helpers import init_mlp

    x, y = digits(32)
    accumulated = Accumulating(init_variables=init_mlp())
    quiet_trainer(max_steps=2).fit(accumulated, loader(x, y, 16))
    plain = Plain(init_variables=init_mlp())
    quiet_trainer(max_steps=1).fit(plain, loader(x, y, 32))
    assert max_abs_diff(accumulated.variables, plain.variables) < 1e-6
    assert max_abs_diff(plain.variables, init_mlp()) > 1e-3  # it did train


def test_on_validation_end_sees_this_validations_metrics():
    class Seen(jl.Callback):
        def __init__(self):
            self.at_end = []

        def on_validation_end(self, trainer, module):
            self.at_end.append(trainer.callback_metrics["val/acc"])

    class Recorder(jl.Logger):
        def __init__(self):
            self.val = []

        @property
        def log_dir(self):
            return ""

        def log_hyperparams(self, params):
            pass

        def log_metrics(self, metrics, step):
            if "val/acc" in metrics:
                self.val.append(metrics["val/acc"])

    seen, recorder = Seen(), Recorder()
    x, y = digits(96)
    trainer = quiet_trainer(max_epochs=3, logger=recorder, callbacks=[seen])
    trainer.fit(LitMLP(lr=3e-2), loader(x, y, 32), loader(*digits(64, 1000), 32))
    assert len(recorder.val) == 3 and len(set(recorder.val)) > 1
    # the sanity check's values reach its on_validation_end too, but no logger
    assert len(seen.at_end) == 4 and seen.at_end[1:] == recorder.val


def test_should_stop_takes_effect_at_the_next_step():
    class StopAt3(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            if trainer.global_step == 3:
                trainer.should_stop = True

    trainer = quiet_trainer(max_epochs=5, callbacks=[StopAt3()])
    trainer.fit(LitMLP(), loader(*digits(80), 8))  # 10 steps per epoch
    # the epoch cut short counts, as in Lightning (test_should_stop_mid_epoch)
    assert trainer.global_step == 3 and trainer.current_epoch == 1


def test_lightning_hooks_on_a_module_warn_with_the_equivalent():
    class Ported(LitMLP):
        def on_before_backward(self, loss):
            raise AssertionError("never called")

    with pytest.warns(UserWarning) as caught:
        quiet_trainer(max_steps=1).fit(Ported(), loader(*digits(16), 8))
    messages = [str(w.message) for w in caught]
    assert any("Ported.on_before_backward() is a PyTorch Lightning hook" in m for m in messages)
    assert any("transform gradients with optax" in m for m in messages)


def test_a_module_batch_hook_with_lightnings_arguments_is_named():
    class Ported(LitMLP):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            raise AssertionError("never called")

    expected = r"Ported.on_train_batch_end\(outputs, batch, batch_idx\): here the hook is"
    with pytest.raises(TypeError, match=expected):
        quiet_trainer(max_steps=1).fit(Ported(), loader(*digits(16), 8))


def test_a_lightning_training_step_signature_is_named():
    class Ported(jl.JaxModule):
        def setup(self, rng, batch):
            return {"params": {}}

        def configure_optimizers(self):
            return optax.sgd(0.1)

        def training_step(self, batch, batch_idx):
            raise AssertionError("never called")

    # Lightning's automatic training_step is loss() here: the error says so
    # (pointing to manual optimization's training_step misled ports; issue 61)
    with pytest.raises(TypeError, match=r"training_step\(batch, batch_idx\) has PyTorch") as info:
        quiet_trainer(max_steps=1).fit(Ported(), loader(*digits(16), 8))
    assert "is loss(self, variables, batch, rngs) here: rename it" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_steps": -2}, ValueError, r"max_steps=-2: expected an int >= -1 \(-1: no step"),
        ({"max_steps": None}, TypeError, r"max_steps=None: expected an int"),
        ({"max_epochs": 1.5}, TypeError, r"max_epochs=1.5: expected an int"),
        ({"max_epochs": -2}, ValueError, r"max_epochs=-2: expected an int >= -1"),
        ({"seed": "0"}, TypeError, r"seed='0': expected an int"),
        ({"seed": -1}, ValueError, r"seed=-1: expected an int >= 0"),
        ({"devices": []}, ValueError, r"devices=\[\]: give at least one device"),
        ({"devices": 0}, ValueError, r"devices=0 but this process has 8"),
        ({"log_every_n_steps": 0}, ValueError, r"log_every_n_steps=0: expected an int >= 1"),
        ({"num_sanity_val_steps": -3}, ValueError, r"num_sanity_val_steps=-3"),
    ],
)
def test_bad_trainer_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        jl.Trainer(**kwargs)


def test_max_epochs_minus_one_means_no_epoch_limit():
    trainer = quiet_trainer(max_epochs=-1, max_steps=12)
    trainer.fit(LitMLP(), loader(*digits(40), 8))  # 5 steps per epoch
    assert trainer.max_epochs == -1  # as Lightning reads it
    # epochs 0 and 1, and epoch 2 cut short by max_steps: Lightning counts all three
    assert trainer.global_step == 12 and trainer.current_epoch == 3


def test_one_pass_training_data_trains_one_pass_and_a_second_epoch_is_named():
    # Lightning trains on any iterable, a generator or an iterator too (one pass):
    # the pass is one epoch, or is cut by max_steps; an epoch that needs the data
    # again is a clear error here (Lightning would run an empty epoch).
    x, y = digits(32)

    def batches():
        return ((x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8))

    def fit(data, **kwargs):
        module = LitMLP(init_variables=init_mlp())
        trainer = quiet_trainer(**kwargs)
        trainer.fit(module, data)
        return trainer, module.variables

    reference, expected = fit([(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)], max_epochs=1)
    trainer, got = fit(batches(), max_epochs=1)
    assert trainer.global_step == reference.global_step == 4
    assert_bitwise_equal(got, expected)
    trainer, _ = fit(iter(loader(x, y, 8)), max_steps=3)  # max_epochs unset: the steps end it
    assert trainer.global_step == 3
    with pytest.raises(TypeError, match=r"train_dataloaders is a generator, which can be"):
        fit(batches(), max_epochs=2)


def test_predict_on_a_shuffled_loader_returns_dataset_order():
    x, y = digits(40)
    model = LitMLP()
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(model, loader(x, y, 8))
    shuffled = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), 8, shuffle=True)
    with pytest.warns(UserWarning, match="predict reads it in dataset order"):
        out = trainer.predict(model, shuffled, concatenate=True)
    np.testing.assert_allclose(out["logits"], np_logits(model.variables["params"], x), atol=1e-4)


@pytest.mark.parametrize("hook", sorted(checks._LIGHTNING_ONLY))
def test_every_lightning_only_hook_gets_its_message(hook):
    module_class = type(f"Uses_{hook}", (LitMLP,), {hook: lambda self, *args: None})
    with pytest.warns(UserWarning, match=rf"Uses_{hook}.{hook}\(\) is a PyTorch Lightning hook"):
        checks.lightning_hooks(module_class())
