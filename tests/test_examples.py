"""Every example runs end to end from its command line on short settings and
reaches its stated metric (the digits main job has its own test)."""

import jax
import numpy as np
import pytest

import jaxlightning as jl
from tests.helpers import load_example

load = load_example


def quiet(root, *extra):
    return [
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}",
        *extra,
    ]


def test_autoencoder_beats_the_mean_image(tmp_path, capsys):
    cli = load("autoencoder").main(quiet(tmp_path, "--trainer.max_epochs=6"))
    assert cli.mse < 0.85 * cli.baseline
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {tmp_path / 'lightning_logs'}" in out
    codes = cli.trainer.predict(cli.model, datamodule=cli.datamodule, concatenate=True)
    assert codes.shape == (360, 3)  # one 3-number code per validation image


@pytest.mark.slow
def test_gan_generates_the_target_distribution(tmp_path):
    gan = load("gan")
    cli = gan.main(quiet(tmp_path, "--trainer.max_epochs=15"))
    assert cli.mean_error < 0.2  # target mean 1.0
    assert 0.15 < cli.std < 0.8  # target spread 0.5: not collapsed to a point
    assert {"d_loss", "g_loss"} <= set(cli.fit_metrics)  # names as logged


@pytest.mark.slow  # synced BatchNorm stays in the fast tier (test_sync_batchnorm.py)
def test_resnet_with_synced_batchnorm_and_augmentation_learns_digits(tmp_path):
    cli = load("resnet").main(quiet(tmp_path, "--trainer.max_epochs=4"))
    assert cli.accuracy > 0.85
    stats = cli.trainer.state.model_state["batch_stats"]
    assert jax.tree.leaves(stats)  # BatchNorm statistics trained and kept


class BackboneAt(jl.Callback):
    """Records the backbone after each update (a copy on the host)."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_end(self, trainer, module, batch_idx):
        backbone = trainer.state.params["backbone"]
        self.seen[trainer.global_step] = jax.tree.map(np.array, backbone)


@pytest.mark.slow  # fine-tuning stays in the fast tier (test_finetuning.py)
def test_finetuning_freezes_the_backbone_then_trains_it(tmp_path):
    finetune = load("finetune")
    cli = finetune.main(
        quiet(
            tmp_path,
            "--trainer.max_epochs=6",
            "--model.freeze_steps=12",
            "--trainer.callbacks+=tests.test_examples.BackboneAt",
        )
    )
    (recorder,) = [c for c in cli.trainer.callbacks if isinstance(c, BackboneAt)]
    pretrained = jax.tree.map(np.asarray, cli.model.backbone_params)
    leaves = jax.tree.leaves
    for a, b in zip(leaves(pretrained), leaves(recorder.seen[12]), strict=True):
        np.testing.assert_array_equal(a, b)  # frozen: not a bit changed in 12 updates
    last = max(recorder.seen)
    assert last > 12
    assert (
        max(
            np.abs(a - b).max()
            for a, b in zip(leaves(pretrained), leaves(recorder.seen[last]), strict=True)
        )
        > 0
    )
    assert cli.accuracy > 0.85


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "tensor_parallel"])
def test_gpt_learns_the_chain_under_sharded_strategies(tmp_path, strategy):
    gpt = load("gpt")
    chosen = (  # FSDP per layer (scanned blocks), bf16 compute, accumulation over 2 batches
        ["--trainer.strategy=fsdp", "--trainer.precision=bf16-mixed",
         "--trainer.accumulate_grad_batches=2", "--model.scan=true", "--model.remat=true"]
        if strategy == "fsdp"
        else ["--trainer.strategy=jaxlightning.ModelParallelStrategy", "--trainer.strategy.model=2"]
    )  # fmt: skip
    cli = gpt.main(quiet(tmp_path, "--trainer.max_steps=60", "--data.batch_size=32", *chosen))
    assert cli.loss < 3.0  # from log(64) = 4.16 towards the chain's entropy, 1.39
