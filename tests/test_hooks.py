"""Module and callback hooks in Lightning's order; DataModules, Lightning's included."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer

CALLBACK_HOOKS = [
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_test_start",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_test_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_exception",
]
MODULE_HOOKS = [
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
]


class Record(jl.Callback):
    def __init__(self, calls):
        self.calls = calls

    def __getattribute__(self, name):
        if name in CALLBACK_HOOKS:
            calls = object.__getattribute__(self, "calls")

            def hook(trainer, module, *args):
                extra = f"({args[0]})" if name in ("setup", "teardown") else ""
                calls.append(f"cb.{name}{extra}")

            return hook
        return object.__getattribute__(self, name)


class HookedModule(LitMLP):
    def __init__(self, calls, **kw):
        super().__init__(**kw)
        self.calls = calls

    def __getattribute__(self, name):
        if name in MODULE_HOOKS:
            calls = object.__getattribute__(self, "calls")
            return lambda *args: calls.append(f"module.{name}")
        return object.__getattribute__(self, name)


VALIDATION = [
    "cb.on_validation_start",
    "cb.on_validation_epoch_start",
    "module.on_validation_epoch_start",
    "cb.on_validation_epoch_end",
    "module.on_validation_epoch_end",
    "cb.on_validation_end",
]


def _epoch(val=True, save=True):
    steps = ["cb.on_train_batch_start", "cb.on_train_batch_end"] * 2
    validation = VALIDATION
    return [
        "cb.on_train_epoch_start",
        "module.on_train_epoch_start",
        *steps,
        *(validation if val else []),
        "cb.on_train_epoch_end",
        "module.on_train_epoch_end",
        # then the monitoring callbacks: the ModelCheckpoint saves here
        *(["cb.on_save_checkpoint", "module.on_save_checkpoint"] if save else []),
    ]


def test_hooks_run_in_the_documented_order_through_fit_validate_test_and_resume(tmp_path):
    calls = []
    x, y = digits(32)
    train, val = loader(x, y, 16), loader(x, y, 16)  # 2 steps per epoch

    def trainer(max_epochs):
        ckpt = jl.ModelCheckpoint()
        return quiet_trainer(
            max_epochs=max_epochs, default_root_dir=tmp_path, callbacks=[Record(calls), ckpt]
        )

    first = trainer(2)
    module = HookedModule(calls)
    first.fit(module, train, val)
    fit_start = ["cb.setup(fit)", "cb.on_fit_start", "module.on_fit_start"]
    fit_start += VALIDATION  # the sanity check's, with its hooks as in Lightning
    fit_start += ["cb.on_train_start", "module.on_train_start"]
    fit_end = ["cb.on_train_end", "module.on_train_end", "cb.on_fit_end", "module.on_fit_end"]
    expected = [*fit_start, *_epoch(), *_epoch(), *fit_end, "cb.teardown(fit)"]
    assert calls == expected

    calls.clear()
    first.validate(module, val)
    first.test(module, val)
    assert calls == [
        "cb.setup(validate)",
        "cb.on_validation_start",
        "cb.on_validation_epoch_start",
        "module.on_validation_epoch_start",
        "cb.on_validation_epoch_end",
        "module.on_validation_epoch_end",
        "cb.on_validation_end",
        "cb.teardown(validate)",
        "cb.setup(test)",
        "cb.on_test_start",
        "cb.on_test_epoch_start",
        "module.on_test_epoch_start",
        "cb.on_test_epoch_end",
        "module.on_test_epoch_end",
        "cb.on_test_end",
        "cb.teardown(test)",
    ]

    calls.clear()
    trainer(3).fit(HookedModule(calls), train, val, ckpt_path="last")
    resumed = ["cb.setup(fit)", "module.on_load_checkpoint", "cb.on_load_checkpoint"]
    resumed += fit_start[1:]
    assert calls == [*resumed, *_epoch(), *fit_end, "cb.teardown(fit)"]


def test_a_failing_fit_calls_on_exception_then_teardown():
    calls = []

    class Boom(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            raise RuntimeError("boom")

    x, y = digits(32)
    with pytest.raises(RuntimeError, match="boom"):
        quiet_trainer(max_epochs=1, callbacks=[Record(calls), Boom()]).fit(
            LitMLP(), loader(x, y, 16)
        )
    assert calls[-2:] == ["cb.on_exception", "cb.teardown(fit)"]


def test_module_sees_its_trainer_and_checkpoint_hooks_carry_extra_state(tmp_path):
    class Stateful(LitMLP):
        def on_train_epoch_end(self):
            assert self.trainer.current_epoch == self.current_epoch
            self.log("epoch_end_step", float(self.global_step))

        def on_save_checkpoint(self, checkpoint):
            checkpoint["my_counter"] = self.global_step * 10

        def on_load_checkpoint(self, checkpoint):
            self.loaded = checkpoint["my_counter"]

    x, y = digits(32)
    first = quiet_trainer(max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=True)
    module = Stateful()
    first.fit(module, loader(x, y, 16))
    assert first.callback_metrics["epoch_end_step"] == 2.0
    again = Stateful()
    quiet_trainer(max_epochs=2, default_root_dir=tmp_path, enable_checkpointing=True).fit(
        again, loader(x, y, 16), ckpt_path="last"
    )
    assert again.loaded == 20
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        _ = LitMLP().trainer


def test_checkpoint_hooks_must_add_json(tmp_path):
    class Unsaveable(LitMLP):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["fn"] = print

    x, y = digits(32)
    trainer = quiet_trainer(max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=True)
    with pytest.raises(TypeError, match="on_save_checkpoint hooks and state_dict methods"):
        trainer.fit(Unsaveable(), loader(x, y, 16))


class DigitsDataModule(L.LightningDataModule):
    """The shape of the DataModule in Lightning's docs, on digits instead of MNIST."""

    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size
        self.stages = []

    def prepare_data(self):
        self.prepared = True  # the docs download here

    def setup(self, stage: str):
        self.stages.append(stage)
        x, y = digits(400)
        full = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        if stage == "fit":
            gen = torch.Generator().manual_seed(42)
            self.train_set, self.val_set = random_split(full, [300, 100], generator=gen)
        if stage == "test":
            self.test_set = TensorDataset(*(torch.from_numpy(a) for a in digits(64, 1000)))
        if stage == "predict":
            self.predict_set = TensorDataset(*(torch.from_numpy(a) for a in digits(40, 1000)))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.predict_set, batch_size=self.batch_size)


def test_a_lightning_datamodule_works_as_datamodule():
    dm = DigitsDataModule()
    model = LitMLP(lr=1e-2)
    trainer = quiet_trainer(max_epochs=3)
    trainer.fit(model, datamodule=dm)
    assert dm.prepared and trainer.datamodule is dm
    assert trainer.global_step == 3 * 10 and "val/acc" in trainer.callback_metrics
    (result,) = trainer.test(model, datamodule=dm)
    out = trainer.predict(model, datamodule=dm, concatenate=True)
    assert out["logits"].shape == (40, 10) and 0 <= result["test/acc"] <= 1
    assert dm.stages == ["fit", "test", "predict"]


def test_a_datamodule_is_asked_for_its_validation_loader_first():
    # Lightning's models/test_hooks.py: val_dataloader (for the sanity check)
    # comes before train_dataloader.
    class Asked(jl.DataModule):
        def __init__(self):
            self.asked = []

        def train_dataloader(self):
            self.asked.append("train")
            return loader(*digits(32), 16)

        def val_dataloader(self):
            self.asked.append("val")
            return loader(*digits(32), 16)

    dm = Asked()
    quiet_trainer(max_epochs=1).fit(LitMLP(), datamodule=dm)
    assert dm.asked == ["val", "train"]


def test_a_jaxlightning_datamodule_state_is_checkpointed(tmp_path):
    class Counting(jl.DataModule):
        def __init__(self):
            self.resumed_from = None

        def train_dataloader(self):
            return loader(*digits(32), 16)

        def state_dict(self):
            return {"epochs_seen": 7}

        def load_state_dict(self, state):
            self.resumed_from = state

    def run(max_epochs, **kw):
        dm = Counting()
        trainer = quiet_trainer(
            max_epochs=max_epochs, default_root_dir=tmp_path, enable_checkpointing=True
        )
        trainer.fit(LitMLP(), datamodule=dm, **kw)
        return dm

    assert run(1).resumed_from is None
    assert run(2, ckpt_path="last").resumed_from == {"epochs_seen": 7}
    with pytest.raises(TypeError, match="defines no test_dataloader"):
        quiet_trainer().test(LitMLP(), datamodule=Counting())


def test_seed_everything_seeds_python_numpy_torch_and_trainers():
    import random

    import numpy as np

    jl.seed_everything(123, workers=True)
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    assert drawn == (random.random(), np.random.rand(), torch.rand(1).item())
    try:
        assert quiet_trainer().seed == 123
        assert quiet_trainer(seed=4).seed == 4
    finally:
        jl.seed_everything(0)
    with pytest.raises(ValueError, match=r"seed_everything\(seed=-3\)"):
        jl.seed_everything(-3)


def test_callbacks_accepts_a_single_callback():
    calls = []
    quiet_trainer(max_steps=1, callbacks=Record(calls)).fit(LitMLP(), loader(*digits(16), 8))
    assert calls[0] == "cb.setup(fit)" and calls[-1] == "cb.teardown(fit)"


# Lightning: trainer.fit(model, dm) / validate(model, dm) (Trainer._run_stage takes a
# LightningDataModule where loaders go), found by porting real Lightning programs.
def test_a_datamodule_passed_where_loaders_go_is_used_as_datamodule():
    dm = DigitsDataModule()
    model = LitMLP(lr=1e-2)
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(model, dm)
    assert trainer.datamodule is dm and trainer.global_step == 10
    (by_position,) = trainer.validate(model, dm)
    (by_keyword,) = trainer.validate(model, datamodule=dm)
    assert by_position == by_keyword and 0 <= by_position["val/acc"] <= 1
    assert trainer.predict(model, dm, concatenate=True)["logits"].shape == (40, 10)


def test_fit_takes_the_loaders_a_module_defines_itself():
    x, y = digits(64)

    class WithLoaders(LitMLP):
        def train_dataloader(self):
            return loader(x, y, 16)

        def val_dataloader(self):
            return loader(x[:32], y[:32], 16)

    trainer = quiet_trainer(max_epochs=2)
    trainer.fit(WithLoaders())
    assert trainer.global_step == 2 * 4 and "val/acc" in trainer.callback_metrics


# Lightning: trainer/configuration_validator.py's warning (tested in its
# tests_pytorch/trainer/test_config_validator.py)
def test_a_val_loader_without_a_validation_step_is_skipped_with_a_warning():
    class NoEval(jl.JaxModule):
        def setup(self, rng, batch):
            return LitMLP().setup(rng, batch)

        def configure_optimizers(self):
            return LitMLP().configure_optimizers()

        def loss(self, variables, batch, rngs):
            return LitMLP().net.apply(variables, batch[0]).mean()

    x, y = digits(32)
    trainer = quiet_trainer(max_epochs=1)
    with pytest.warns(UserWarning, match="no `validation_step`.*Skipping val loop") as caught:
        trainer.fit(NoEval(), loader(x, y, 16), loader(x, y, 16))
    skipped = [w for w in caught if "Skipping val loop" in str(w.message)]
    assert skipped[0].filename == __file__  # points at the user's fit line
    assert trainer.global_step == 2 and not any(
        k.startswith("val") for k in trainer.callback_metrics
    )


def test_a_module_sees_the_trainers_loggers_while_it_runs(tmp_path):
    seen = []

    class Looks(LitMLP):
        def on_fit_start(self):
            seen.append(self.loggers)

    logger = jl.CSVLogger(save_dir=tmp_path)
    quiet_trainer(max_steps=1, logger=logger).fit(Looks(), loader(*digits(16), 8))
    assert seen == [[logger]] and Looks().loggers == []


@pytest.mark.parametrize(("max_epochs", "batch_idx_"), [(2, 5), (3, 8), (4, 12)])
def test_on_train_batch_start_return_minus_one(max_epochs, batch_idx_):
    """Lightning's loops/test_training_loop.py::test_on_train_batch_start_return_minus_one:
    -1 from the module's on_train_batch_start skips the rest of the epoch."""
    seen = []

    class SkipFrom(LitMLP):
        def on_train_batch_start(self, batch_idx):
            seen.append((self.trainer.current_epoch, batch_idx, self.trainer.is_last_batch))
            if batch_idx == batch_idx_:
                return -1

    x, y = digits(160)
    trainer = quiet_trainer(max_epochs=max_epochs)
    trainer.fit(SkipFrom(), loader(x, y, 16))  # 10 batches an epoch
    if batch_idx_ > trainer.num_training_batches - 1:
        assert trainer.global_step == trainer.num_training_batches * max_epochs
    else:
        assert trainer.global_step == batch_idx_ * max_epochs
    assert trainer.is_last_batch  # the batch that returned -1 ended the epoch (Lightning 2.6)
    assert trainer.current_epoch == max_epochs
    assert [last for _, i, last in seen if i == 9] in ([True] * max_epochs, [])
    assert not any(last for _, i, last in seen if i < 9)


def test_batch_hooks_run_where_overridden_however_they_are_defined():
    """Batch hooks are called only where someone overrides them: by a subclass,
    a function set on the instance, or a mixin; a module's batch hook logs."""
    seen = []

    class Mixin:
        def on_train_batch_start(self, trainer, module, batch_idx):
            seen.append(("mixin", batch_idx))

    class FromMixin(Mixin, jl.Callback):
        pass

    on_instance = jl.Callback()
    on_instance.on_train_batch_end = lambda trainer, module, i: seen.append(("instance", i))

    class Logs(LitMLP):
        def on_train_batch_end(self, batch_idx):
            seen.append(("module", batch_idx))
            self.log("batch_idx", float(batch_idx))

    trainer = quiet_trainer(max_epochs=1, callbacks=[jl.Callback(), FromMixin(), on_instance])
    trainer.fit(Logs(), loader(*digits(48), 16))
    assert seen == [(who, i) for i in range(3) for who in ("mixin", "instance", "module")]
    assert float(trainer.callback_metrics["batch_idx"]) == 2.0  # the last batch's
