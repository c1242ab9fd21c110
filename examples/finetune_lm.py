"""Fine-tune a pretrained Llama-architecture language model, with LoRA adapters.

    python examples/finetune_lm.py fit --model.pretrained DIR --data.documents FILE.jsonl \\
        [--model.lora_rank 8] [--trainer.max_steps 200] [--model.export OUT_DIR]

``DIR`` is a folder ``transformers``' ``LlamaForCausalLM.save_pretrained`` wrote
(``config.json`` and safetensors, sharded or not); ``FILE.jsonl`` holds one
``{"input_ids": [...]}`` per document. The documents are joined into one token
stream and cut into rows of ``--data.seq_len`` tokens; the loss is the mean
next-token cross-entropy, as ``transformers`` computes it with ``labels=input_ids``.

``--model.lora_rank 8`` trains rank-8 adapters on ``--model.lora_targets``
(default: the attention's query and value projections), the pretrained weights
frozen; ``--model.lora_rank 0`` fine-tunes every weight. After the fit the
weights (adapters merged in) go to ``--model.export`` as a folder that
``LlamaForCausalLM.from_pretrained`` loads.

The model is written in Flax linen: RMSNorm, rotary positions, SwiGLU and
grouped-query attention, its parameter names chosen so that `HF_LLAMA` below
(one rule per kind of weight) maps ``transformers``' names onto them.
"""

from __future__ import annotations

import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from torch.utils.data import DataLoader

import jaxlightning as jl

# transformers' names -> this model's paths; "T": a torch Linear weight is (out, in),
# a flax Dense kernel (in, out).
HF_LLAMA = [
    ("model.embed_tokens.weight", "params/embed_tokens/embedding"),
    ("model.layers.{i}.self_attn.{proj}.weight", "params/layers_{i}/self_attn/{proj}/kernel", "T"),
    ("model.layers.{i}.mlp.{proj}.weight", "params/layers_{i}/mlp/{proj}/kernel", "T"),
    ("model.layers.{i}.{norm}.weight", "params/layers_{i}/{norm}/weight"),
    ("model.norm.weight", "params/norm/weight"),
    ("lm_head.weight", "params/lm_head/kernel", "T"),
]


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + self.eps)
        return weight * normed.astype(x.dtype)


def rotate(x, positions, theta):
    """Rotary position embedding as transformers' Llama applies it (halves rotated)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(0, half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * inv_freq  # (seq, half)
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
    heads: int
    kv_heads: int
    head_dim: int
    theta: float

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)  # noqa: E731
        q = dense(self.heads * self.head_dim, "q_proj")(x).reshape(b, t, self.heads, -1)
        k = dense(self.kv_heads * self.head_dim, "k_proj")(x).reshape(b, t, self.kv_heads, -1)
        v = dense(self.kv_heads * self.head_dim, "v_proj")(x).reshape(b, t, self.kv_heads, -1)
        positions = jnp.arange(t)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        repeat = self.heads // self.kv_heads  # grouped-query: each kv head serves `repeat`
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(q.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(q.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, -1)
        return dense(x.shape[-1], "o_proj")(out)


class Mlp(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(self.hidden, use_bias=False, name="gate_proj")(x)
        up = nn.Dense(self.hidden, use_bias=False, name="up_proj")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.silu(gate) * up)


class Block(nn.Module):
    config: dict

    @nn.compact
    def __call__(self, x):
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 1e4)
        attention = Attention(c["num_attention_heads"], kv_heads, head_dim, theta, name="self_attn")
        x = x + attention(RMSNorm(c["rms_norm_eps"], name="input_layernorm")(x))
        mlp = Mlp(c["intermediate_size"], name="mlp")
        return x + mlp(RMSNorm(c["rms_norm_eps"], name="post_attention_layernorm")(x))


class Llama(nn.Module):
    """``LlamaForCausalLM``'s computation, from its ``config.json`` (as a dict)."""

    config: dict

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = nn.Embed(c["vocab_size"], c["hidden_size"], name="embed_tokens")
        x = embed(tokens)
        for i in range(c["num_hidden_layers"]):
            x = Block(c, name=f"layers_{i}")(x)
        x = RMSNorm(c["rms_norm_eps"], name="norm")(x)
        if c.get("tie_word_embeddings"):
            return embed.attend(x)
        return nn.Dense(c["vocab_size"], use_bias=False, name="lm_head")(x)


def next_token_loss(logits, tokens):
    """Mean cross-entropy of each row's predictions of its next tokens."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]
    )
    return losses.mean(-1)  # per row: every row predicts seq_len - 1 tokens


class FineTuneLM(jl.JaxModule):
    def __init__(
        self,
        pretrained: str,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: str = r"self_attn/(q_proj|v_proj)/kernel$",
        lr: float = 1e-3,
        export: str | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        with open(os.path.join(pretrained, "config.json")) as f:
            self.config = json.load(f)
        self.net = Llama(self.config)
        if lora_rank:
            self.lora = jl.LoRA(rank=lora_rank, alpha=lora_alpha, targets=lora_targets)

    def setup(self, rng, batch):
        return self.net.init(rng, batch["input_ids"])

    def pretrained(self, into):
        return jl.load_weights(self.hparams.pretrained, into, rename=HF_LLAMA)

    def loss(self, variables, batch, rngs):
        logits = self.net.apply(variables, batch["input_ids"])
        losses = next_token_loss(logits, batch["input_ids"])
        self.log("train_loss", losses, prog_bar=True)
        return losses

    def eval_step(self, variables, batch):
        logits = self.net.apply(variables, batch["input_ids"])
        self.log("val_loss", next_token_loss(logits, batch["input_ids"]), prog_bar=True)

    def configure_optimizers(self):
        return optax.adamw(self.hparams.lr, weight_decay=0.0)

    def on_fit_end(self):
        if self.hparams.export:
            self.save_pretrained(self.hparams.export)

    def save_pretrained(self, folder: str) -> None:
        """The weights (adapters merged) as a folder ``from_pretrained`` loads."""
        variables = self.variables if self.lora is None else self.lora.merged(self.variables)
        jl.save_weights({"params": variables["params"]}, folder, rename=HF_LLAMA)
        for name in ("config.json", "generation_config.json"):
            source = os.path.join(self.hparams.pretrained, name)
            if os.path.exists(source):
                shutil.copy(source, folder)


class Documents(jl.DataModule):
    """Documents (one ``{"input_ids": [...]}`` per line) joined and cut into
    rows of ``seq_len`` tokens; the last ``val_fraction`` of rows for validation."""

    def __init__(
        self, documents: str, seq_len: int = 64, batch_size: int = 8, val_fraction: float = 0.1
    ):
        self.documents, self.seq_len = documents, seq_len
        self.batch_size, self.val_fraction = batch_size, val_fraction

    def setup(self, stage: str) -> None:
        with open(self.documents) as f:
            stream = np.concatenate([json.loads(line)["input_ids"] for line in f if line.strip()])
        rows = stream[: len(stream) // self.seq_len * self.seq_len].reshape(-1, self.seq_len)
        cut = len(rows) - max(1, int(len(rows) * self.val_fraction))
        self.train, self.val = rows[:cut].astype(np.int32), rows[cut:].astype(np.int32)

    def _loader(self, rows, shuffle):
        data = [{"input_ids": torch.from_numpy(r)} for r in rows]
        generator = torch.Generator().manual_seed(0)
        return DataLoader(data, self.batch_size, shuffle=shuffle, generator=generator)

    def train_dataloader(self):
        return self._loader(self.train, True)

    def val_dataloader(self):
        return self._loader(self.val, False)


def main(argv: list[str] | None = None) -> jl.cli.LightningCLI:
    return jl.cli.LightningCLI(
        FineTuneLM,
        Documents,
        trainer_defaults={"max_steps": 200, "log_every_n_steps": 10},
        args=argv,
        default_subcommand="fit",
    )


if __name__ == "__main__":
    main()
