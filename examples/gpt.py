"""A small GPT-style language model, annotated for tensor parallelism.

    python examples/gpt.py [--strategy auto|fsdp|tp] [--max-steps 300]

The data is synthetic and learnable: token sequences drawn from a fixed random
Markov chain whose next token has entropy ``ENTROPY`` nats, so a model that has
learnt the chain reaches a validation loss near that value (a model that has
learnt nothing: log(vocab) = 4.16). The layers carry Megatron-style
partitioning annotations (attention heads and the MLP's hidden units split over
a ``"model"`` mesh axis): with ``--strategy tp`` they are placed by
`jl.ModelParallelStrategy`; with the data-parallel strategies the annotations
only say where arrays would go and change nothing.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import jaxlightning as jl  # noqa: E402

VOCAB = 64
BRANCHES = 4  # each token is followed by one of 4 tokens, equally likely
ENTROPY = float(np.log(BRANCHES))


def _split(*names: str | None):
    """A kernel initialiser carrying a partitioning annotation over the mesh axes."""
    return nn.with_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    """Pre-norm Transformer block: attention heads and MLP hidden units are
    split over ``"model"`` (column-parallel in, row-parallel out)."""

    d_model: int
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, train: bool):
        b, t, d = x.shape
        hd = d // self.heads
        h = nn.LayerNorm()(x)
        # No key bias: softmax ignores it, so its gradient is zero up to
        # rounding, which Adam would turn into steps of full size.
        q, k, v = (
            nn.Dense(d, use_bias=name != "key", kernel_init=_split(None, "model"), name=name)(
                h
            ).reshape(b, t, self.heads, hd)
            for name in ("query", "key", "value")
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(np.float32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        weights = nn.Dropout(self.dropout, deterministic=not train)(weights)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        out = nn.Dense(d, kernel_init=_split("model", None), name="out")(out)
        x = x + nn.Dropout(self.dropout, deterministic=not train)(out)
        h = nn.LayerNorm()(x)
        h = nn.Dense(
            4 * d,
            kernel_init=_split(None, "model"),
            bias_init=nn.with_partitioning(nn.initializers.zeros, ("model",)),
        )(h)
        h = nn.Dense(d, kernel_init=_split("model", None))(nn.gelu(h))
        return x + nn.Dropout(self.dropout, deterministic=not train)(h)


class GPT(nn.Module):
    vocab: int = VOCAB
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    context: int = 32
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        t = tokens.shape[1]
        x = nn.Embed(self.vocab, self.d_model)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.context, self.d_model))[:t]
        for _ in range(self.layers):
            x = Block(self.d_model, self.heads, self.dropout)(x, train)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class LitGPT(jl.JaxModule):
    """Next-token prediction; the loss is per sequence (mean over its tokens)."""

    def __init__(
        self,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        context: int = 32,
        dropout: float = 0.1,
        lr: float = 3e-3,
        warmup: float = 0.1,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.net = GPT(VOCAB, d_model, heads, layers, context, dropout)

    def setup(self, rng, batch):
        return self.net.init(rng, batch[:, :-1])

    def configure_optimizers(self):
        hp = self.hparams
        total = int(self.trainer.estimated_stepping_batches)  # sized to the run
        warmup = max(int(hp.warmup * total), 1)
        schedule = optax.warmup_cosine_decay_schedule(0.0, hp.lr, warmup, max(total, warmup + 1))
        return optax.adamw(schedule, weight_decay=0.01)

    def _token_losses(self, variables, tokens, **kwargs):
        logits = self.net.apply(variables, tokens[:, :-1], **kwargs)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return losses.mean(-1)

    def loss(self, variables, batch, rngs):
        return self._token_losses(variables, batch, train=True, rngs=rngs)

    def eval_step(self, variables, batch):
        self.log("loss", self._token_losses(variables, batch), prog_bar=True)

    def predict_step(self, variables, batch):
        return self.net.apply(variables, batch[:, :-1])[:, -1].argmax(-1)


def markov_tokens(n: int, length: int, seed: int = 0) -> np.ndarray:
    """``n`` sequences of ``length`` tokens from a fixed random chain (the same
    chain for every seed; ``seed`` picks the sequences)."""
    successors = np.random.default_rng(1234).integers(0, VOCAB, size=(VOCAB, BRANCHES))
    rng = np.random.default_rng(seed)
    tokens = np.empty((n, length), np.int32)
    tokens[:, 0] = rng.integers(0, VOCAB, n)
    for t in range(1, length):
        tokens[:, t] = successors[tokens[:, t - 1], rng.integers(0, BRANCHES, n)]
    return tokens


def loaders(batch_size: int, context: int = 32, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    train = torch.from_numpy(markov_tokens(2048, context + 1, seed))
    val = torch.from_numpy(markov_tokens(256, context + 1, seed + 1))
    generator = torch.Generator().manual_seed(seed)
    return (
        DataLoader(train, batch_size, shuffle=True, generator=generator),
        DataLoader(val, batch_size),
    )


STRATEGIES = {
    "auto": lambda: "auto",
    "fsdp": lambda: "fsdp",
    "tp": lambda: jl.ModelParallelStrategy(model=2),
}


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="auto")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--root-dir", default=".")
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)

    train, val = loaders(args.batch_size)
    model = LitGPT()
    trainer = jl.Trainer(
        max_steps=args.max_steps,
        strategy=STRATEGIES[args.strategy](),
        precision=args.precision,
        gradient_clip_val=1.0,
        val_check_interval=100,
        check_val_every_n_epoch=None,
        default_root_dir=args.root_dir,
        enable_progress_bar=not args.no_progress_bar,
    )
    print(f"Training with {trainer.strategy!r} on {jax.device_count()} device(s)")
    print(f"TensorBoard: tensorboard --logdir {os.path.dirname(trainer.log_dir)}")
    trainer.fit(model, train, val)
    (result,) = trainer.validate(model, val)
    loss = result["val/loss"]
    print(f"Final validation loss: {loss:.4f} (the chain's entropy: {ENTROPY:.4f})")
    return loss


if __name__ == "__main__":
    main()
