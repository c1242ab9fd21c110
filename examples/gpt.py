"""A small GPT-style language model, annotated for tensor parallelism.

    python examples/gpt.py [fit] [--trainer.max_steps 300] [--trainer.strategy fsdp]
        [--trainer.precision bf16-mixed] [--trainer.accumulate_grad_batches 2]
        [--model.scan false]                # blocks unrolled (default: one nn.scan,
                                            # where FSDP gathers block by block)
        [--model.remat true]                # recompute each block in the backward pass
        [--model.remat_policy dots_saveable]  # what remat keeps (jax.checkpoint_policies)
    python examples/gpt.py --trainer.strategy jaxlightning.ModelParallelStrategy \
        --trainer.strategy.model 2          # tensor parallel: data 4 x model 2

The data is synthetic and learnable: token sequences drawn from a fixed random
Markov chain whose next token has entropy ``ENTROPY`` nats, so a model that has
learnt the chain reaches a validation loss near that value (a model that has
learnt nothing: log(vocab) = 4.16). The layers carry Megatron-style
partitioning annotations (attention heads and the MLP's hidden units split over
a ``"model"`` mesh axis): under `jl.ModelParallelStrategy` they place the
arrays; under data parallel and FSDP they change nothing. Trained with AdamW, a
warmup + cosine schedule sized by ``trainer.estimated_stepping_batches``, and
gradient clipping.
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
    fsdp: bool = False  # annotate the kernels' other dimension with the data axis

    @nn.compact
    def __call__(self, x, train: bool):
        b, t, d = x.shape
        hd = d // self.heads
        data = jl.AXIS if self.fsdp else None  # split over the data axis under FSDP
        h = nn.LayerNorm()(x)
        # No key bias: softmax ignores it, so its gradient is zero up to
        # rounding, which Adam would turn into steps of full size.
        q, k, v = (
            nn.Dense(d, use_bias=name != "key", kernel_init=_split(data, "model"), name=name)(
                h
            ).reshape(b, t, self.heads, hd)
            for name in ("query", "key", "value")
        )
        # a Python float keeps the scores in q's dtype (bfloat16 under bf16-mixed;
        # a float32 scalar would lift the rest of the block to float32)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(hd))
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        weights = nn.Dropout(self.dropout, deterministic=not train)(weights)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        out = nn.Dense(d, kernel_init=_split("model", data), name="out")(out)
        x = x + nn.Dropout(self.dropout, deterministic=not train)(out)
        h = nn.LayerNorm()(x)
        h = nn.Dense(
            4 * d,
            kernel_init=_split(data, "model"),
            bias_init=nn.with_partitioning(nn.initializers.zeros, ("model",)),
        )(h)
        h = nn.Dense(d, kernel_init=_split("model", data))(nn.gelu(h))
        return x + nn.Dropout(self.dropout, deterministic=not train)(h)


class GPT(nn.Module):
    vocab: int = VOCAB
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    context: int = 32
    dropout: float = 0.1
    remat: bool = False
    scan: bool = True
    remat_policy: str = "nothing_saveable"

    def _policy(self):
        """The `jax.checkpoint_policies` member named ``remat_policy``."""
        policy = getattr(jax.checkpoint_policies, self.remat_policy, None)
        if policy is None or not callable(policy):
            raise ValueError(
                f"remat_policy={self.remat_policy!r} is not a jax.checkpoint_policies member; "
                "use e.g. 'nothing_saveable', 'dots_saveable' or "
                "'dots_with_no_batch_dims_saveable'"
            )
        return policy

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        t = tokens.shape[1]
        x = nn.Embed(self.vocab, self.d_model)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.context, self.d_model))[:t]
        if self.scan:
            x = self._scanned_blocks(x, train)
        else:
            # With remat a block keeps for the backward pass what the policy
            # saves (by default only its input) and runs its forward again there.
            block = Block
            if self.remat:
                block = nn.remat(Block, static_argnums=(2,), policy=self._policy())
            for i in range(self.layers):
                x = block(self.d_model, self.heads, self.dropout, name=f"Block_{i}")(x, train)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))

    def _scanned_blocks(self, x, train: bool):
        """The blocks as one loop over stacked parameters (``nn.scan``): each
        block gathers its own parameters under FSDP (`jl.fsdp_gathered`), so a
        device holds one block's parameters whole at a time."""
        # Without remat a block keeps its matmul results (fsdp_gathered's default).
        block = jl.fsdp_gathered(ScanBlock, policy=self._policy() if self.remat else None)
        blocks = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.layers,
            metadata_params={nn.PARTITION_NAME: None},
        )
        x, _ = blocks(self.d_model, self.heads, self.dropout, train, name="Blocks")(x, None)
        return x


class ScanBlock(nn.Module):
    """A `Block` with nn.scan's signature ``(carry, x) -> (carry, y)``."""

    d_model: int
    heads: int
    dropout: float
    train: bool

    @nn.compact
    def __call__(self, x, _):
        y = Block(self.d_model, self.heads, self.dropout, fsdp=True)(x, self.train)
        return y.astype(x.dtype), None  # a loop's carry keeps its dtype (bf16-mixed)


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
        remat: bool = False,
        scan: bool = True,
        remat_policy: str = "nothing_saveable",
    ):
        super().__init__()
        self.save_hyperparameters()
        self.net = GPT(VOCAB, d_model, heads, layers, context, dropout, remat, scan, remat_policy)

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


class MarkovTokens(jl.DataModule):
    """Sequences of ``context + 1`` tokens: 2048 to train on, 256 to validate."""

    def __init__(self, batch_size: int = 64, context: int = 32, seed: int = 0):
        self.batch_size, self.context, self.seed = batch_size, context, seed

    def train_dataloader(self):
        train = torch.from_numpy(markov_tokens(2048, self.context + 1, self.seed))
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(train, self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self):
        val = torch.from_numpy(markov_tokens(256, self.context + 1, self.seed + 1))
        return DataLoader(val, self.batch_size)


class GptCLI(jl.cli.LightningCLI):
    def before_fit(self) -> None:
        print(f"Training with {self.trainer.strategy!r} on {jax.device_count()} device(s)")

    def after_fit(self) -> None:
        (result,) = self.trainer.validate(self.model, datamodule=self.datamodule)
        self.loss = result["loss"]
        print(f"Final validation loss: {self.loss:.4f} (the chain's entropy: {ENTROPY:.4f})")


def main(argv: list[str] | None = None) -> GptCLI:
    return GptCLI(
        LitGPT,
        MarkovTokens,
        trainer_defaults={
            "max_steps": 300,
            "gradient_clip_val": 1.0,
            "val_check_interval": 100,
            "check_val_every_n_epoch": None,
            "log_every_n_steps": 10,
        },
        args=argv,
        default_subcommand="fit",
    )


if __name__ == "__main__":
    main()
