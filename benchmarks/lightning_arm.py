"""The same MLP and DataLoader under PyTorch Lightning (the `bench` extra)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.common import LR


def available() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def _module(features: int) -> Any:
    import lightning as L

    class LitTorchMLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(features, 256),
                nn.ReLU(),
                nn.Linear(256, 256),
                nn.ReLU(),
                nn.Linear(256, 10),
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            acc = (self.net(x).argmax(-1) == y).float().mean()
            self.log("val/acc", acc)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=LR)

    return LitTorchMLP()


def fit(
    train: DataLoader,
    epochs: int,
    root: str,
    val: DataLoader | None = None,
    first_step: list[float] | None = None,
) -> list[float]:
    """Lightning's fit with its defaults but no progress bar; returns epoch times."""
    import lightning as L

    times: list[float] = []

    class Times(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if first_step is not None and not first_step:
                first_step.append(time.perf_counter())

        def on_train_epoch_end(self, trainer, module):
            times.append(time.perf_counter() - self.start)

    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[Times()],
        enable_model_summary=False,
    )
    trainer.fit(_module(train.dataset.tensors[0].shape[1]), train, val)
    return times
