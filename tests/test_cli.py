"""The LightningCLI-style command line, through examples/digits.py's `main`."""

from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import jaxlightning as jl
from tests.helpers import load_example


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
         "--trainer.callbacks.monitor", "val/loss"],
    )  # fmt: skip
    assert cli.subcommand == "fit"
    assert cli.trainer.global_step == 6
    assert cli.model.hparams.lr == 0.005 and cli.model.hparams.hidden == 64
    assert cli.trainer.state.params["Dense_0"]["kernel"].shape == (64, 64)
    assert cli.datamodule.batch_size == 32
    stopping = [c for c in cli.trainer.callbacks if isinstance(c, jl.EarlyStopping)]
    assert [c.monitor for c in stopping] == ["val/loss"]
    assert 0 < cli.accuracy <= 1  # after_fit ran


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
    assert set(result) == {"val/acc", "val/loss"}


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
