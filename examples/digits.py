"""Train an MLP on scikit-learn's digits, data-parallel over every local device.

    python examples/digits.py [fit] [--trainer.max_epochs 30] [--data.batch_size 128]
        [--model.lr 1e-3] [--config cfg.yaml] [--print_config]
    python examples/digits.py validate --ckpt_path last

On a machine without an accelerator, 8 CPU devices are simulated so the run is
data-parallel all the same. Logs go to ./lightning_logs/version_N.
"""

from __future__ import annotations

import os

# Must happen before jax is imported; it only affects the CPU platform, so it is
# harmless where a GPU or TPU is present.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jaxlightning as jl  # noqa: E402


class MLP(nn.Module):
    hidden: int = 256
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = False):
        for _ in range(2):
            x = nn.relu(nn.Dense(self.hidden)(x))
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(10)(x)


class LitDigits(jl.JaxModule):
    def __init__(self, hidden: int = 256, lr: float = 1e-3, dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = MLP(hidden, dropout)

    def setup(self, rng, batch):
        return self.net.init(rng, batch[0])

    def configure_optimizers(self):
        return optax.adam(self.hparams.lr)

    def loss(self, variables, batch, rngs):
        x, y = batch
        logits = self.net.apply(variables, x, train=True, rngs=rngs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", logits.argmax(-1) == y)
        return loss

    def eval_step(self, variables, batch):
        x, y = batch
        logits = self.net.apply(variables, x)
        self.log("loss", optax.softmax_cross_entropy_with_integer_labels(logits, y))
        self.log("acc", logits.argmax(-1) == y)

    def predict_step(self, variables, batch):
        return self.net.apply(variables, batch[0]).argmax(-1)


def digits_loaders(batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Standardised digits, 80/20 split, as torch DataLoaders."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order].astype(np.float32) / 16.0, y[order].astype(np.int64)
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    x = (x - mean) / std
    train = TensorDataset(torch.from_numpy(x[:cut]), torch.from_numpy(y[:cut]))
    val = TensorDataset(torch.from_numpy(x[cut:]), torch.from_numpy(y[cut:]))
    generator = torch.Generator().manual_seed(seed)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(val, batch_size=batch_size),
    )


class DigitsData(jl.DataModule):
    """The digits loaders: ``batch_size`` per process, a seeded 80/20 split."""

    def __init__(self, batch_size: int = 128, seed: int = 0):
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: str) -> None:
        self.train, self.val = digits_loaders(self.batch_size, self.seed)

    def train_dataloader(self):
        return self.train

    def val_dataloader(self):
        return self.val

    test_dataloader = predict_dataloader = val_dataloader


class DigitsCLI(jl.cli.LightningCLI):
    """Says where it trains before ``fit``, and the final accuracy after it."""

    def before_fit(self) -> None:
        devices = jax.devices()
        if devices[0].platform == "cpu":
            self.say(f"No accelerator found: simulating {len(jax.local_devices())} CPU devices.")
        self.say(
            f"Training data-parallel on {len(devices)} {devices[0].platform} device(s)"
            + (f" in {jax.process_count()} processes." if jax.process_count() > 1 else ".")
        )

    def after_fit(self) -> None:
        (result,) = self.trainer.validate(self.model, datamodule=self.datamodule)
        self.accuracy = result["acc"]
        self.say(f"Final validation accuracy: {result['acc']:.4f} (loss {result['loss']:.4f})")

    def say(self, text: str) -> None:
        if jax.process_index() == 0:
            print(text, flush=True)


def main(argv: list[str] | None = None) -> float | None:
    """``fit`` (the default), ``validate``, ``test`` or ``predict``, with
    ``--trainer.*``, ``--model.*``, ``--data.*`` or ``--config cfg.yaml``;
    returns the final validation accuracy of a ``fit``."""
    cli = DigitsCLI(
        LitDigits,
        DigitsData,
        trainer_defaults={"max_epochs": 30, "log_every_n_steps": 10},
        args=argv,
        default_subcommand="fit",
        description=__doc__.splitlines()[0],
    )
    return getattr(cli, "accuracy", None)


if __name__ == "__main__":
    main()
