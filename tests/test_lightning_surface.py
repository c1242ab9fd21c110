"""The module and Trainer surface a Lightning port relies on: ``model(x)`` with the
current weights, evaluation without passing the module, ``accelerator=``,
``rank_zero_only``, Lightning's ``seed_everything`` (cases from
tests/tests_pytorch/ of Lightning, cited per test)."""

import os

import jax
import numpy as np
import pytest

import jaxlightning as jl
from jaxlightning import seed as seed_module
from tests.helpers import LitMLP, digits, init_mlp, loader, np_logits, quiet_trainer

X, Y = digits(64)
VX, VY = digits(16, 500)


class WithForward(LitMLP):
    def forward(self, variables, x):
        return self.net.apply(variables, x)

    def predict_step(self, variables, batch):
        return {"logits": self.forward(variables, batch[0])}  # forward is usable traced too


class Probe(jl.Callback):
    """Calls the module as Lightning callbacks do: ``pl_module(x)``."""

    def __init__(self):
        self.outputs = []
        self.states = []

    def on_train_epoch_end(self, trainer, module):
        self.outputs.append(np.asarray(module(VX)))
        self.states.append(trainer.state.variables)


def test_calling_the_module_uses_its_current_weights():
    probe = Probe()
    module = WithForward()
    trainer = quiet_trainer(max_epochs=2, callbacks=[probe])
    trainer.fit(module, loader(X, Y, 16))
    # in a callback, during fit: the train state's weights at that moment
    for out, variables in zip(probe.outputs, probe.states, strict=True):
        np.testing.assert_allclose(out, np_logits(variables["params"], VX), rtol=1e-4, atol=1e-4)
    assert not np.allclose(probe.outputs[0], probe.outputs[1])  # it trained in between
    # after fit: the trained weights
    np.testing.assert_allclose(
        np.asarray(module(VX)), np_logits(module.variables["params"], VX), rtol=1e-4, atol=1e-4
    )


def test_torch_module_habits_of_ported_code_work():
    """Lightning code calls the module with torch tensors, moves it with
    ``.to(device)``/``.cpu()``, reads ``self.device`` and switches
    ``.eval()``/``.train()`` (issue 61): each does what a port needs."""
    import torch

    module = WithForward()
    module.variables = init_mlp()
    assert module.to("cuda") is module and module.cpu() is module and module.cuda() is module
    assert module.device == jax.devices()[0]
    assert module.eval() is module and module.training is False
    assert module.train().training is True
    out = module(torch.from_numpy(VX))  # converted on the way in
    np.testing.assert_allclose(np.asarray(out), np_logits(init_mlp()["params"], VX), rtol=1e-4)


def test_calling_the_module_without_forward_or_weights_says_what_to_do():
    with pytest.raises(NotImplementedError, match="does not define"):
        LitMLP()(VX)
    with pytest.raises(RuntimeError, match="no weights yet"):
        WithForward()(VX)

    class LightningForward(LitMLP):
        def forward(self, x):  # Lightning's signature: no variables
            return x

    with pytest.raises(TypeError, match=r"forward\(self, variables, x\)"):
        LightningForward()(VX)


class Digits(jl.DataModule):
    def train_dataloader(self):
        return loader(X, Y, 16)

    def val_dataloader(self):
        return loader(VX, VY, 8)

    def test_dataloader(self):
        return loader(VX, VY, 8)

    def predict_dataloader(self):
        return loader(VX, VY, 8)


def test_test_and_predict_with_best_checkpoint_without_the_module(tmp_path):
    # trainer/test_trainer.py::test_tested_checkpoint_path ("best", model not passed)
    checkpoint = jl.ModelCheckpoint(monitor="acc", mode="max")
    trainer = jl.Trainer(
        max_epochs=2, default_root_dir=tmp_path, callbacks=[checkpoint],
        enable_progress_bar=False, logger=False, enable_model_summary=False,
    )  # fmt: skip
    module, dm = WithForward(), Digits()
    trainer.fit(module, datamodule=dm)
    assert trainer.lightning_module is module
    (results,) = trainer.test(ckpt_path="best", datamodule=dm)
    best = WithForward.load_from_checkpoint(checkpoint.best_model_path)
    logits = np_logits(best.variables["params"], VX)
    assert results["acc"] == pytest.approx(float(np.mean(logits.argmax(-1) == VY)))
    out = trainer.predict(ckpt_path="best", datamodule=dm, concatenate=True)
    np.testing.assert_allclose(out["logits"], logits, rtol=1e-4, atol=1e-4)


def test_validate_and_test_take_lightnings_arguments_and_print_the_results(tmp_path, capsys):
    # Lightning's validate(model, dataloaders, ckpt_path, verbose, datamodule): the
    # order, and verbose=True (the default) printing the results table
    ckpt = jl.ModelCheckpoint()
    trainer = quiet_trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[ckpt])
    trainer.fit(LitMLP(), loader(*digits(32), 16))
    capsys.readouterr()
    (results,) = trainer.validate(LitMLP(), loader(VX, VY, 8), "last")
    out = capsys.readouterr().out
    assert "Validate metric" in out and "DataLoader 0" in out
    assert f"{results['val/acc']:.6g}" in out.split("val/acc")[1].splitlines()[0]
    trainer.test(LitMLP(), loader(VX, VY, 8), "last", False)
    assert capsys.readouterr().out == ""


def test_evaluating_without_a_module_before_fit_is_a_clear_error():
    with pytest.raises(TypeError, match=r"trainer.validate\(\) needs the module"):
        quiet_trainer().validate(dataloaders=loader(VX, VY, 8))


def test_accelerator_cpu_and_a_missing_one():
    # trainer/connectors/test_accelerator_connector.py: a named accelerator
    assert quiet_trainer(accelerator="cpu").num_devices == jax.local_device_count("cpu")
    with pytest.raises(RuntimeError, match="accelerator='gpu', but JAX finds no gpu device"):
        quiet_trainer(accelerator="gpu")
    with pytest.raises(ValueError, match="accelerator='xpu'"):
        quiet_trainer(accelerator="xpu")


def test_rank_zero_only_runs_on_process_zero():
    calls = []

    @jl.rank_zero_only
    def record(value):
        calls.append(value)
        return value

    assert record(3) == 3 and calls == [3]  # this is process 0


def test_lightnings_seed_everything_seeds_the_trainer(monkeypatch):
    # Lightning's seed_everything leaves its seed in PL_GLOBAL_SEED
    monkeypatch.setattr(seed_module, "_global_seed", None)
    monkeypatch.setitem(os.environ, "PL_GLOBAL_SEED", "1234")
    assert quiet_trainer().seed == 1234


def test_loss_may_return_lightnings_loss_dict():
    # Lightning's training_step may return {"loss": loss}
    class DictLoss(LitMLP):
        def loss(self, variables, batch, rngs):
            return {"loss": super().loss(variables, batch, rngs)}

    variables = init_mlp()
    plain, as_dict = LitMLP(init_variables=variables), DictLoss(init_variables=variables)
    for module in (plain, as_dict):
        quiet_trainer(max_steps=2).fit(module, loader(X, Y, 16))
    for a, b in zip(
        jax.tree.leaves(plain.variables), jax.tree.leaves(as_dict.variables), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_model_summary_shows_sizes_of_example_input_array(capsys, kind):
    # callbacks/test_model_summary.py: "In sizes" / "Out sizes" from example_input_array
    # (a torch tensor, as Lightning code sets it, crashed the summary: issue 61)
    import torch

    module = WithForward()
    example = np.zeros((5, 64), np.float32)
    module.example_input_array = example if kind == "numpy" else torch.from_numpy(example)
    jl.Trainer(max_steps=1, logger=False, enable_progress_bar=False,
               enable_checkpointing=False).fit(module, loader(X, Y, 16))  # fmt: skip
    assert "In sizes: [5, 64] -- Out sizes: [5, 10]" in capsys.readouterr().out


class _StageSetup(LitMLP):
    """Lightning's ``setup(stage)``; the variables from ``configure_model``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = []

    def setup(self, stage):
        self.calls.append(("setup", stage))

    def teardown(self, stage):
        self.calls.append(("teardown", stage))

    def configure_model(self, rng, batch):
        return self.net.init(rng, batch[0]) if self.init_variables is None else self.init_variables


class _StageCallback(jl.Callback):
    def setup(self, trainer, module, stage):
        assert module is not None
        self.stage = stage
        module.calls.append(("callback", stage))


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_setup_is_called_with_the_stage(stage):
    """trainer/test_trainer.py::test_trainer_setup_call: the module's setup(stage)
    gets the stage, after the callbacks' (Lightning's order), and teardown(stage)
    ends the call; the variables come from configure_model(rng, batch)."""
    variables = init_mlp()
    module, callback = _StageSetup(init_variables=variables), _StageCallback()
    trainer = quiet_trainer(max_epochs=1, callbacks=[callback])
    data = loader(X, Y, 16)
    if stage == "fit":
        trainer.fit(module, data)
        assert trainer.global_step == 4
    else:
        out = getattr(trainer, stage)(module, data)
        if stage == "predict":
            got = np.concatenate([np.asarray(b["logits"]) for b in out])
            np.testing.assert_allclose(got, np_logits(variables["params"], X), atol=1e-4)
    assert callback.stage == stage
    assert module.calls == [("callback", stage), ("setup", stage), ("teardown", stage)]


def test_a_stage_setup_without_configure_model_says_what_to_define():
    class NoModel(LitMLP):
        def setup(self, stage):
            pass

    with pytest.raises(NotImplementedError, match=r"configure_model\(self, rng, batch\)"):
        quiet_trainer(max_epochs=1).fit(NoModel(), loader(X, Y, 16))


def test_predict_returns_a_list_of_per_batch_outputs():
    """trainer/test_trainer.py::test_trainer_predict_* and
    loops/test_prediction_loop.py: predict returns one output per batch, a list per
    loader with several; return_predictions=False returns None; concatenate=True
    gives one row per example (padding removed from the last, smaller batch)."""
    variables = init_mlp()
    module = LitMLP(init_variables=variables)
    trainer = quiet_trainer()
    expected = np_logits(variables["params"], X)
    out = trainer.predict(module, loader(X, Y, 24))  # 64 rows: 24, 24, 16
    assert isinstance(out, list) and [len(b["logits"]) for b in out] == [24, 24, 16]
    for i, batch in enumerate(out):
        np.testing.assert_allclose(batch["logits"], expected[24 * i : 24 * i + 24], atol=1e-4)
    two = trainer.predict(module, [loader(X, Y, 32), loader(VX, VY, 16)])
    assert [len(per_loader) for per_loader in two] == [2, 1]
    assert trainer.predict(module, loader(X, Y, 24), return_predictions=False) is None
    joined = trainer.predict(module, loader(X, Y, 24), concatenate=True)
    np.testing.assert_allclose(joined["logits"], expected, atol=1e-4)


class Ranks(LitMLP):
    """Reads what Lightning modules read of their process in a host hook."""

    def on_train_start(self):
        self.seen = (self.global_rank, self.local_rank, self.logger)


def test_the_module_and_trainer_know_their_process_and_logger(tmp_path, monkeypatch):
    # Lightning's LightningModule.global_rank / local_rank / logger and the
    # Trainer's global_rank / local_rank / world_size / is_global_zero.
    module = Ranks()
    assert (module.global_rank, module.local_rank, module.logger) == (0, 0, None)
    logger = jl.CSVLogger(tmp_path)
    trainer = quiet_trainer(max_steps=1, logger=logger)
    trainer.fit(module, loader(X, Y, 16))
    assert module.seen == (0, 0, logger)
    assert (trainer.global_rank, trainer.world_size, trainer.is_global_zero) == (0, 1, True)
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert trainer.local_rank == 2  # SLURM's word for it
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert trainer.local_rank == 3  # the launcher's (torchrun's, this project's) first


class OwnLoaders(WithForward):
    """A module that brings its loaders, as a LightningModule may."""

    def train_dataloader(self):
        return loader(X, Y, 16)

    def test_dataloader(self):
        return loader(VX, VY, 8)

    def predict_dataloader(self):
        return loader(VX, VY, 8)


def test_test_and_predict_read_the_modules_own_loaders():
    # Lightning: trainer.test(model) / predict(model) with no loaders use the
    # module's test_dataloader() / predict_dataloader()
    trainer = quiet_trainer(max_epochs=1, stage_prefix=False)
    module = OwnLoaders()
    trainer.fit(module)
    (results,) = trainer.test(module)
    logits = np_logits(module.variables["params"], VX)
    assert results["acc"] == pytest.approx(float(np.mean(logits.argmax(-1) == VY)))
    out = trainer.predict(module, concatenate=True)
    np.testing.assert_allclose(out["logits"], logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match=r"val_dataloader\(\)"):
        trainer.validate(module)  # it brings no validation loader
