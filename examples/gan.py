"""A GAN with manual optimization: two optimizers, two updates per step.

    python examples/gan.py [fit] [--trainer.max_epochs 40] [--model.lr_d 1e-2]

The generator learns to turn 4-D Gaussian noise into samples of a 6-D Gaussian
with mean 1.0 and standard deviation 0.5. Both updates run in one compiled
step: ``optimizers.step(loss_fn, group)`` updates one group and returns its
loss (Lightning's ``manual_backward`` + ``opt.step()`` in one call). The noise
comes with each batch, so a run is reproducible and resumable exactly. The
metric is the distance of the generated samples' mean and spread from the
target's. Lightning's version side by side: docs/porting.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jaxlightning as jl  # noqa: E402

DIM, NOISE, MEAN, STD = 6, 4, 1.0, 0.5


class Generator(nn.Module):
    @nn.compact
    def __call__(self, z):
        return nn.Dense(DIM)(nn.tanh(nn.Dense(32)(z)))


class Discriminator(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(32)(x)))[:, 0]


class LitGAN(jl.JaxModule):
    def __init__(self, lr_g: float = 5e-3, lr_d: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.generator, self.discriminator = Generator(), Discriminator()

    def setup(self, rng, batch):
        x, z = batch
        kg, kd = jax.random.split(rng)
        return {
            "params": {
                "generator": self.generator.init(kg, z)["params"],
                "discriminator": self.discriminator.init(kd, x)["params"],
            }
        }

    def configure_optimizers(self):  # one optimizer per top-level group of params
        return {
            "generator": optax.adam(self.hparams.lr_g, b1=0.5),
            "discriminator": optax.adam(self.hparams.lr_d, b1=0.5),
        }

    def _fake(self, params, z):
        return self.generator.apply({"params": params["generator"]}, z)

    def _logit(self, params, x):
        return self.discriminator.apply({"params": params["discriminator"]}, x)

    def d_loss(self, params, x, z):
        fake = jax.lax.stop_gradient(self._fake(params, z))
        return jax.nn.softplus(-self._logit(params, x)) + jax.nn.softplus(self._logit(params, fake))

    def g_loss(self, params, z):
        return jax.nn.softplus(-self._logit(params, self._fake(params, z)))

    def training_step(self, optimizers, batch, rngs):
        x, z = batch
        d = optimizers.step(lambda p: self.d_loss(p, x, z), "discriminator")
        g = optimizers.step(lambda p: self.g_loss(p, z), "generator")  # sees the new D
        self.log_dict({"d_loss": d, "g_loss": g}, prog_bar=True)

    def eval_step(self, variables, batch):
        _, z = batch
        fake = self._fake(variables["params"], z)
        self.log("mean_error", jnp.abs(fake.mean(-1) - MEAN))
        self.log("fake_std", fake.std(-1))

    def predict_step(self, variables, batch):
        return self._fake(variables["params"], batch[1])


class GaussianData(jl.DataModule):
    """Pairs (real sample, generator noise); 2048 for training, 512 to check."""

    def __init__(self, batch_size: int = 64):
        self.batch_size = batch_size

    @staticmethod
    def _pairs(n: int, seed: int) -> TensorDataset:
        rng = np.random.default_rng(seed)
        x = rng.normal(MEAN, STD, (n, DIM)).astype(np.float32)
        z = rng.normal(size=(n, NOISE)).astype(np.float32)
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(z))

    def train_dataloader(self):
        return DataLoader(self._pairs(2048, 0), self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(0))  # fmt: skip

    def val_dataloader(self):
        return DataLoader(self._pairs(512, 1), self.batch_size)

    predict_dataloader = val_dataloader


class GanCLI(jl.cli.LightningCLI):
    def after_fit(self) -> None:
        self.fit_metrics = dict(self.trainer.callback_metrics)  # predict starts them afresh
        fake = self.trainer.predict(self.model, datamodule=self.datamodule, concatenate=True)
        self.mean_error = float(np.abs(fake.mean() - MEAN))
        self.std = float(fake.std(0).mean())
        print(
            f"Generated: mean {fake.mean():.3f} (target {MEAN}), std {self.std:.3f} (target {STD})"
        )


def main(argv: list[str] | None = None) -> GanCLI:
    return GanCLI(
        LitGAN,
        GaussianData,
        trainer_defaults={"max_epochs": 40, "log_every_n_steps": 16},
        args=argv,
        default_subcommand="fit",
    )


if __name__ == "__main__":
    main()
