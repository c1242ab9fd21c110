"""Lightning's autoencoder example, ported: encode digits to 3 numbers and back.

    python examples/autoencoder.py [fit] [--trainer.max_epochs 20] [--model.lr 1e-3]

Lightning's version (lightning.ai's "LitAutoEncoder", on MNIST) and this one side
by side are in docs/porting.md. The data are scikit-learn's 8x8 digits (64
pixels in [0, 1]), so it runs anywhere without a download. The metric is the
validation reconstruction error against the baseline of always predicting the
mean image.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import jaxlightning as jl  # noqa: E402


class LitAutoEncoder(jl.JaxModule):
    def __init__(self, code: int = 3, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(code)])
        self.decoder = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(64)])

    def setup(self, rng, batch):
        code = jnp.zeros((1, self.hparams.code))
        return {
            "params": {
                "encoder": self.encoder.init(rng, batch)["params"],
                "decoder": self.decoder.init(rng, code)["params"],
            }
        }

    def _reconstruct(self, params, x):
        z = self.encoder.apply({"params": params["encoder"]}, x)
        return self.decoder.apply({"params": params["decoder"]}, z)

    def loss(self, variables, batch, rngs):
        x_hat = self._reconstruct(variables["params"], batch)
        return ((x_hat - batch) ** 2).mean(-1)  # per example: exact on padded batches

    def eval_step(self, variables, batch):
        x_hat = self._reconstruct(variables["params"], batch)
        self.log("mse", ((x_hat - batch) ** 2).mean(-1), prog_bar=True)

    def predict_step(self, variables, batch):  # the 3-number codes
        return self.encoder.apply({"params": variables["params"]["encoder"]}, batch)

    def configure_optimizers(self):
        return optax.adam(self.hparams.lr)


class DigitPixels(jl.DataModule):
    """Digits as 64 pixels in [0, 1]; 80/20 split. The loaders yield tensors."""

    def __init__(self, batch_size: int = 64):
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        x = load_digits().data.astype(np.float32) / 16.0
        order = np.random.default_rng(0).permutation(len(x))
        cut = int(0.8 * len(x))
        self.train, self.val = x[order[:cut]], x[order[cut:]]
        self.baseline = float(((self.val - self.train.mean(0)) ** 2).mean())

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            torch.from_numpy(self.train), self.batch_size, shuffle=True, generator=generator
        )

    def val_dataloader(self):
        return DataLoader(torch.from_numpy(self.val), self.batch_size)

    predict_dataloader = val_dataloader


class AutoEncoderCLI(jl.cli.LightningCLI):
    def after_fit(self) -> None:
        (result,) = self.trainer.validate(self.model, datamodule=self.datamodule)
        self.mse, self.baseline = result["mse"], self.datamodule.baseline
        print(f"Validation MSE {self.mse:.4f} (predicting the mean image: {self.baseline:.4f})")


def main(argv: list[str] | None = None) -> AutoEncoderCLI:
    return AutoEncoderCLI(
        LitAutoEncoder,
        DigitPixels,
        trainer_defaults={"max_epochs": 20, "log_every_n_steps": 10},
        args=argv,
        default_subcommand="fit",
    )


if __name__ == "__main__":
    main()
