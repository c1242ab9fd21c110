"""The LightningCLI-style command line, through examples/digits.py's `main`, and
cases translated from Lightning's tests/tests_pytorch/test_cli.py (named in each)."""

import os
import random
from pathlib import Path

import flax.linen as nn
import jax
import jsonargparse
import numpy as np
import optax
import pytest
import torch
import yaml

import jaxlightning as jl
from jaxlightning import seed as jl_seed
from jaxlightning.cli import LightningCLI, SaveConfigCallback
from tests.helpers import digits as digits_data
from tests.helpers import load_example, loader


@pytest.fixture(scope="module")
def digits():
    return load_example("digits")


def short(root, *extra):
    return [
        "--trainer.max_steps",
        "6",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(root),
        *extra,
    ]


def run(digits, args):
    cli = digits.DigitsCLI(digits.LitDigits, digits.DigitsData, args=args, default_subcommand="fit")
    return cli, jax.tree.map(np.asarray, cli.trainer.state.params)


def test_fit_with_flags_sets_trainer_model_and_data(digits, tmp_path):
    cli, _ = run(
        digits,
        ["fit", *short(tmp_path), "--model.lr", "0.005", "--model.hidden", "64",
         "--data.batch_size", "32", "--trainer.callbacks+=EarlyStopping",
         "--trainer.callbacks.monitor", "loss"],
    )  # fmt: skip
    assert cli.subcommand == "fit"
    assert cli.trainer.global_step == 6
    assert cli.model.hparams.lr == 0.005 and cli.model.hparams.hidden == 64
    assert cli.trainer.state.params["Dense_0"]["kernel"].shape == (64, 64)
    assert cli.datamodule.batch_size == 32
    stopping = [c for c in cli.trainer.callbacks if isinstance(c, jl.EarlyStopping)]
    assert [c.monitor for c in stopping] == ["loss"]
    assert 0 < cli.accuracy <= 1  # after_fit ran


@pytest.mark.slow
def test_a_yaml_config_and_print_config_round_trip_into_the_same_run(digits, tmp_path, capsys):
    flags = short(tmp_path / "flags", "--model.lr", "0.003", "--trainer.seed", "7")
    with pytest.raises(SystemExit) as exit_:
        digits.main(["fit", *flags, "--print_config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    config = yaml.safe_load(printed)
    assert config["model"]["lr"] == 0.003 and config["trainer"]["seed"] == 7
    config["trainer"]["default_root_dir"] = str(tmp_path / "config")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))

    by_flags, params_flags = run(digits, ["fit", *flags])
    by_config, params_config = run(digits, ["fit", "--config", str(path)])
    assert by_config.trainer.seed == 7 and by_config.model.hparams.lr == 0.003
    for a, b in zip(jax.tree.leaves(params_flags), jax.tree.leaves(params_config), strict=True):
        np.testing.assert_array_equal(a, b)  # the identical run, bit for bit
    # fit saved its whole configuration in the run directory: it reruns the run too.
    saved = yaml.safe_load((Path(by_flags.trainer.log_dir) / "config.yaml").read_text())
    assert saved["model"] == config["model"] and saved["trainer"]["seed"] == 7


def test_validate_subcommand_from_the_last_checkpoint(digits, tmp_path):
    run(digits, ["fit", *short(tmp_path)])
    cli = digits.DigitsCLI(
        digits.LitDigits,
        digits.DigitsData,
        args=["validate", *short(tmp_path), "--ckpt_path", "last"],
    )
    (result,) = cli.result
    assert set(result) == {"acc", "loss"}  # as logged, Lightning's names


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--trainer.max_epochs", "three"], "trainer.max_epochs"),
        (["--model.lr", "fast"], "model.lr"),
        (["--trainer.no_such_flag", "1"], "no_such_flag"),
        (["--data.batch_size", "1.5"], "data.batch_size"),
    ],
)
def test_bad_arguments_exit_non_zero_naming_the_argument(digits, args, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        digits.main(["fit", *args])
    assert exit_.value.code != 0
    assert named in capsys.readouterr().err


def test_a_missing_subcommand_is_required_without_a_default(digits, capsys):
    with pytest.raises(SystemExit) as exit_:
        jl.cli.LightningCLI(digits.LitDigits, digits.DigitsData, args=["--model.lr", "0.1"])
    assert exit_.value.code != 0
    assert "subcommand" in capsys.readouterr().err.lower()


# ------------------------------------------------ Lightning's CLI test cases
@pytest.fixture(autouse=True)
def _restore_global_seed():
    """`seed_everything` (which the CLI runs) sets process-wide state: put it back."""
    saved = (
        jl_seed._global_seed,
        {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")},
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
    )
    yield
    jl_seed._global_seed, env, py_state, np_state, torch_state = saved
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)


class TinyModel(jl.JaxModule):
    """A linear classifier (Lightning's BoringModelRequiredClasses)."""

    def __init__(self, num_classes: int = 10, batch_size: int = 8, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.num_classes, self.batch_size = num_classes, batch_size
        self.net = nn.Dense(num_classes)

    def setup(self, rng, batch):
        return self.net.init(rng, batch[0])

    def configure_optimizers(self):
        return optax.sgd(self.hparams.lr)

    def loss(self, variables, batch, rngs):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(self.net.apply(variables, x), y)

    def eval_step(self, variables, batch):
        x, y = batch
        self.log("acc", self.net.apply(variables, x).argmax(-1) == y)


class TinyData(jl.DataModule):
    """Digits with labels folded into ``num_classes``, known once built
    (Lightning's BoringDataModuleBatchSizeAndClasses)."""

    def __init__(self, batch_size: int = 8):
        self.batch_size = batch_size
        self.num_classes = 5  # only available after instantiation

    def train_dataloader(self):
        x, y = digits_data(16)
        return loader(x, y % self.num_classes, self.batch_size)

    test_dataloader = train_dataloader


def tiny(root, *extra):
    """A quick run: one step, nothing printed, logs under ``root``."""
    return [
        "--trainer.max_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={root}",
        *extra,
    ]


def save_config_callback(cli):
    return next(c for c in cli.trainer.callbacks if isinstance(c, SaveConfigCallback))


@pytest.mark.parametrize(
    ("default", "args", "expected"),
    [
        (False, [], False),
        (True, [], "an int"),
        (False, ["--seed_everything", "3"], 3),
        (True, ["--seed_everything", "3"], 3),
        (10, ["--seed_everything", "3"], 3),
        (10, ["--seed_everything", "false"], False),
        (True, ["--seed_everything", "false"], False),
        (False, ["--seed_everything", "true"], "an int"),
    ],
)
def test_cli_auto_seeding(default, args, expected):
    # Lightning: test_cli_auto_seeding. True seeds with seed_everything's own
    # seed: here PL_GLOBAL_SEED, else 0 (Lightning draws a random one).
    os.environ.pop("PL_GLOBAL_SEED", None)
    jl_seed._global_seed = None
    cli = LightningCLI(TinyModel, args=args, run=False, seed_everything_default=default)
    assert cli.seed_everything_default == default
    seed = cli.config["seed_everything"]
    if expected == "an int":
        assert isinstance(seed, int) and not isinstance(seed, bool) and seed == 0
    else:
        assert seed is expected if isinstance(expected, bool) else seed == expected
    # The Trainer's JAX keys follow the seed (0, its default, when not seeded).
    assert cli.trainer.seed == (0 if seed is False else seed)


def test_cli_seed_everything_keeps_an_earlier_seed_and_yields_to_trainer_seed():
    # Lightning: test_cli_auto_seeding (its last case: the original seed is kept).
    jl.seed_everything(123)
    cli = LightningCLI(TinyModel, args=[], run=False)
    assert cli.config["seed_everything"] == 123 and cli.trainer.seed == 123
    cli = LightningCLI(TinyModel, args=["--seed_everything=3", "--trainer.seed=5"], run=False)
    assert cli.config["seed_everything"] == 3 and cli.trainer.seed == 5  # the explicit one
    assert torch.initial_seed() == 3


def test_lightning_cli_callback_trainer_default():
    # Lightning: test_lightning_cli_callback_trainer_default, with instances too.
    checkpoint = jl.ModelCheckpoint(monitor="val/acc", mode="max")
    cli = LightningCLI(
        TinyModel,
        TinyData,
        trainer_defaults={
            "logger": {
                "class_path": "jaxlightning.TensorBoardLogger",
                "init_args": {"save_dir": ".", "name": "demo"},
            },
            "callbacks": [
                checkpoint,
                {"class_path": "EarlyStopping", "init_args": {"monitor": "val/acc"}},
            ],
        },
        args=["--trainer.callbacks+=LearningRateMonitor"],
        run=False,
    )
    assert cli.trainer.logger.name == "demo"
    kinds = [type(c) for c in cli.trainer.callbacks]
    # The command line's, then the defaults', then the config saver.
    assert kinds.index(jl.LearningRateMonitor) < kinds.index(jl.ModelCheckpoint)
    assert kinds.index(jl.ModelCheckpoint) < kinds.index(jl.EarlyStopping)
    assert kinds.index(jl.EarlyStopping) < kinds.index(SaveConfigCallback)
    assert cli.trainer.checkpoint_callback is checkpoint
    # Not arguments: the configuration (and a saved config.yaml) leaves them out.
    assert [c["class_path"] for c in cli.config["trainer"]["callbacks"]] == [
        "jaxlightning.LearningRateMonitor"
    ]


def test_trainer_defaults_that_cannot_be_defaults_are_named(tmp_path):
    # Lightning's: jsonargparse's "Subclass types require as default either a
    # dict with class_path or a lazy instance", without the key.
    with pytest.raises(
        ValueError,
        match=r"trainer_defaults\['logger'\] is a CSVLogger instance: .* Give \{'class_path': "
        r"'jaxlightning.loggers.csv.CSVLogger', 'init_args': \{...\}\} or "
        r"jsonargparse.lazy_instance\(CSVLogger, ...\)",
    ):
        LightningCLI(TinyModel, trainer_defaults={"logger": jl.CSVLogger(tmp_path)}, run=False)
    with pytest.raises(ValueError, match=r"trainer_defaults\['max_epoch'\]: Trainer has no"):
        LightningCLI(TinyModel, trainer_defaults={"max_epoch": 3}, run=False)
    lazy = jsonargparse.lazy_instance(jl.CSVLogger, save_dir=str(tmp_path))
    cli = LightningCLI(TinyModel, trainer_defaults={"logger": lazy}, args=[], run=False)
    assert isinstance(cli.trainer.logger, jl.CSVLogger)


@pytest.mark.parametrize("args", [[], ["--trainer.callbacks=EarlyStopping"]])
def test_lightning_cli_single_arg_callback_and_fast_dev_run_saves_no_config(args):
    # Lightning: test_lightning_cli_single_arg_callback, and the fast_dev_run
    # case of test_lightning_cli_save_config_cases.
    args = [*args, "--trainer.callbacks.monitor=val/acc"] if args else []
    cli = LightningCLI(TinyModel, args=[*args, "--trainer.fast_dev_run=1"], run=False)
    assert not any(isinstance(c, SaveConfigCallback) for c in cli.trainer.callbacks)
    if args:
        given = cli.config.trainer.callbacks  # a list of one here (Trainer's type hint)
        assert [c.class_path for c in given] == ["jaxlightning.EarlyStopping"]
        assert [c.monitor for c in cli.trainer.callbacks if isinstance(c, jl.EarlyStopping)] == [
            "val/acc"
        ]


def test_lightning_cli_configurable_callbacks():
    # Lightning: test_lightning_cli_configurable_callbacks (run=False).
    class MyLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(jl.LearningRateMonitor, "learning_rate_monitor")

    cli = MyLightningCLI(
        TinyModel, args=["--learning_rate_monitor.logging_interval=epoch"], run=False
    )
    callback = [c for c in cli.trainer.callbacks if isinstance(c, jl.LearningRateMonitor)]
    assert len(callback) == 1
    assert callback[0].logging_interval == "epoch"


def test_lightning_cli_link_arguments_and_config_saved_once_at_fit(tmp_path):
    # Lightning: test_lightning_cli_link_arguments and
    # test_lightning_cli_save_config_only_once (run=False, then the user's fit).
    class MyLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.link_arguments("data.batch_size", "model.batch_size")
            parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")

    cli = MyLightningCLI(
        TinyModel, TinyData, args=tiny(tmp_path, "--data.batch_size=12"), run=False
    )
    assert cli.model.batch_size == 12
    assert cli.model.num_classes == 5
    callback = save_config_callback(cli)
    assert not callback.overwrite and not callback.already_saved

    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.model.hparams == {"batch_size": 12, "num_classes": 5, "lr": 0.1}
    config = yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())
    assert callback.already_saved
    assert config["data"] == {"batch_size": 12} and config["seed_everything"] == 0
    assert "batch_size" not in config["model"]  # a link's target is computed, not saved
    cli.trainer.test(cli.model, datamodule=cli.datamodule)  # saved already: no error


def test_lightning_cli_save_config_cases_overwrite_and_filename(tmp_path):
    # Lightning: test_lightning_cli_save_config_cases, test_cli_config_overwrite,
    # test_cli_config_filename, test_lightning_cli_save_config_seed_everything and
    # test_lightning_cli_args. Here a run directory is the logger's: a fixed
    # version makes two runs share one.
    logger = [
        "--trainer.logger=CSVLogger",
        f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.logger.version=0",
    ]
    run_dir = tmp_path / "lightning_logs" / "version_0"
    args = ["fit", *tiny(tmp_path, *logger)]

    cli = LightningCLI(TinyModel, TinyData, args=[*args, "--seed_everything=true"])
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert isinstance(config["seed_everything"], int)
    assert config["seed_everything"] == cli.config.fit.seed_everything
    assert config["trainer"] == cli.config["fit"].as_dict()["trainer"]

    # Run again in the same directory: refused, the earlier config is kept.
    with pytest.raises(RuntimeError, match="Aborting to avoid overwriting"):
        LightningCLI(TinyModel, TinyData, args=args)

    LightningCLI(
        TinyModel,
        TinyData,
        args=[*args, "--seed_everything=1234"],
        save_config_kwargs={"overwrite": True},
    )
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed_everything"] == 1234

    LightningCLI(
        TinyModel, TinyData, args=args, save_config_kwargs={"config_filename": "name.yaml"}
    )
    assert (run_dir / "name.yaml").is_file()


def test_a_resumed_fit_keeps_its_run_directory_and_config(tmp_path):
    # Not in Lightning (a resumed run gets a new directory there): here a fit
    # resumed from a checkpoint continues its run directory, and its config.
    args = ["fit", *tiny(tmp_path, "--trainer.enable_checkpointing=true")]
    first = LightningCLI(TinyModel, TinyData, args=args)
    saved = (Path(first.trainer.log_dir) / "config.yaml").read_text()
    resumed = LightningCLI(
        TinyModel, TinyData, args=[*args, "--trainer.max_steps=2", "--ckpt_path=last"]
    )
    assert resumed.trainer.global_step == 2
    assert resumed.trainer.log_dir == first.trainer.log_dir
    assert (Path(resumed.trainer.log_dir) / "config.yaml").read_text() == saved


def test_save_to_log_dir_false_error():
    # Lightning: test_save_to_log_dir_false_error.
    with pytest.raises(ValueError, match=r"save_to_log_dir=False\) saves nothing"):
        SaveConfigCallback(jl.cli.LightningArgumentParser(), {}, save_to_log_dir=False)


def test_a_subclass_fit_method_runs_instead_of_the_trainers(tmp_path):
    """Lightning's rule (LightningCLI._run_subcommand: ``getattr(self, subcommand,
    trainer's)``): a subclass's own ``fit`` is what the subcommand runs, called
    with ``model=`` and the subcommand's keyword arguments."""
    calls = []

    class MyCLI(LightningCLI):
        def fit(self, model, **kwargs):
            calls.append(sorted(kwargs))
            self.trainer.fit(model, **kwargs)

    cli = MyCLI(TinyModel, TinyData, args=["fit", *tiny(tmp_path, "--trainer.logger=false")])
    assert calls == [["ckpt_path", "datamodule"]]
    assert cli.trainer.global_step == 1


def test_config_is_saved_into_default_root_dir_without_a_logger(tmp_path):
    """Lightning's SaveConfigCallback writes into trainer.log_dir, which is
    default_root_dir when there is no logger."""
    LightningCLI(TinyModel, TinyData, args=["fit", *tiny(tmp_path, "--trainer.logger=false")])
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["trainer"]["max_steps"] == 1 and config["trainer"]["logger"] is False
