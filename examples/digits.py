"""Train an MLP on scikit-learn's digits, data-parallel over every local device.

    python examples/digits.py [--epochs 30] [--batch-size 128]

On a machine without an accelerator, 8 CPU devices are simulated so the run is
data-parallel all the same. Logs go to ./lightning_logs/version_N.
"""

from __future__ import annotations

import argparse
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
        self.log("acc", logits.argmax(-1) == y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

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


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--root-dir", default=".")
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    # The Trainer comes first: in a multi-process job it must connect the
    # processes before anything touches the devices.
    trainer = jl.Trainer(
        max_epochs=args.epochs,
        default_root_dir=args.root_dir,
        enable_progress_bar=not args.no_progress_bar,
        log_every_n_steps=10,
    )
    say = print if jax.process_index() == 0 else (lambda *a: None)
    devices = jax.devices()
    if devices[0].platform == "cpu":
        say(f"No accelerator found: simulating {len(jax.local_devices())} CPU devices.")
    say(
        f"Training data-parallel on {len(devices)} {devices[0].platform} device(s)"
        + (f" in {jax.process_count()} processes." if jax.process_count() > 1 else ".")
    )

    train_loader, val_loader = digits_loaders(args.batch_size)
    model = LitDigits(lr=args.lr)
    trainer.fit(model, train_loader, val_loader)
    (result,) = trainer.validate(model, val_loader)
    say(f"Final validation accuracy: {result['val/acc']:.4f} (loss {result['val/loss']:.4f})")
    say(f"TensorBoard: tensorboard --logdir {os.path.dirname(trainer.log_dir)}")
    return result["val/acc"]


if __name__ == "__main__":
    main()
