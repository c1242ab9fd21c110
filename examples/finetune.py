"""Fine-tuning: a pretrained backbone, frozen at first, then trained with the head.

    python examples/finetune.py [fit] [--model.freeze_steps 40] [--trainer.max_epochs 10]

The backbone (two dense layers) is pretrained on the digits 0-4; fine-tuning
trains a new head for the digits 5-9. For its first ``freeze_steps`` updates
the backbone's learning rate is exactly zero (an optax schedule in a
``multi_transform`` by parameter group), so only the head learns; then both
train, the backbone with a smaller rate (Lightning's ``BackboneFinetuning``
does this with a callback that edits optimizer groups; in JAX the optimizer is
a pure function of the step, so a schedule says it). Stated metric: validation
accuracy on 5-9 (about 0.97).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jaxlightning as jl  # noqa: E402


class Backbone(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(128)(nn.relu(nn.Dense(128)(x))))


class Classifier(jl.JaxModule):
    """Backbone + a head for 5 classes; ``backbone_params`` start it pretrained."""

    def __init__(
        self,
        lr: float = 3e-3,
        backbone_lr: float = 3e-4,
        freeze_steps: int = 40,
        backbone_params: dict | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=("backbone_params",))
        self.backbone, self.head = Backbone(), nn.Dense(5)
        self.backbone_params = backbone_params

    def setup(self, rng, batch):
        x = batch[0]
        backbone = self.backbone_params or self.backbone.init(rng, x)["params"]
        features = self.backbone.apply({"params": backbone}, x)
        return {"params": {"backbone": backbone, "head": self.head.init(rng, features)["params"]}}

    def configure_optimizers(self):
        hp = self.hparams
        frozen_then_slow = optax.join_schedules(
            [optax.constant_schedule(0.0), optax.constant_schedule(hp.backbone_lr)],
            [hp.freeze_steps],
        )
        return optax.multi_transform(
            {"backbone": optax.adam(frozen_then_slow), "head": optax.adam(hp.lr)},
            {"backbone": "backbone", "head": "head"},  # labels: a prefix of the params
        )

    def _logits(self, params, x):
        features = self.backbone.apply({"params": params["backbone"]}, x)
        return self.head.apply({"params": params["head"]}, features)

    def loss(self, variables, batch, rngs):
        x, y = batch
        logits = self._logits(variables["params"], x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", logits.argmax(-1) == y, prog_bar=True)
        return loss

    def eval_step(self, variables, batch):
        x, y = batch
        logits = self._logits(variables["params"], x)
        self.log("loss", optax.softmax_cross_entropy_with_integer_labels(logits, y))
        self.log("acc", logits.argmax(-1) == y, prog_bar=True)


class DigitsSubset(jl.DataModule):
    """Digits ``first``..``first``+4, labelled 0..4; 80/20 split."""

    def __init__(self, first: int = 5, batch_size: int = 64):
        self.first, self.batch_size = first, batch_size

    def setup(self, stage: str) -> None:
        x, y = load_digits(return_X_y=True)
        keep = (y >= self.first) & (y < self.first + 5)
        x, y = (x[keep] / 16.0).astype(np.float32), (y[keep] - self.first).astype(np.int64)
        order = np.random.default_rng(0).permutation(len(x))
        cut = int(0.8 * len(x))
        tensors = torch.from_numpy(x[order]), torch.from_numpy(y[order])
        self.train = TensorDataset(*(t[:cut] for t in tensors))
        self.val = TensorDataset(*(t[cut:] for t in tensors))

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        return DataLoader(self.train, self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self):
        return DataLoader(self.val, self.batch_size)


def pretrain_backbone(epochs: int = 10) -> dict:
    """The backbone's parameters after training on the digits 0-4."""
    module = Classifier(freeze_steps=0, backbone_lr=3e-3)
    trainer = jl.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=DigitsSubset(first=0))
    return module.variables["params"]["backbone"]


class FinetuneCLI(jl.cli.LightningCLI):
    def before_fit(self) -> None:
        print("Pretraining the backbone on the digits 0-4 ...")
        self.model.backbone_params = pretrain_backbone()

    def after_fit(self) -> None:
        (result,) = self.trainer.validate(self.model, datamodule=self.datamodule)
        self.accuracy = result["acc"]
        print(f"Fine-tuned validation accuracy on 5-9: {self.accuracy:.4f}")


def main(argv: list[str] | None = None) -> FinetuneCLI:
    return FinetuneCLI(
        Classifier,
        DigitsSubset,
        trainer_defaults={"max_epochs": 10, "log_every_n_steps": 5},
        args=argv,
        default_subcommand="fit",
    )


if __name__ == "__main__":
    main()
