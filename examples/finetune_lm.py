"""Fine-tune a pretrained Llama-architecture language model, with LoRA adapters.

    python examples/finetune_lm.py fit --model.pretrained DIR --data.documents FILE.jsonl \\
        [--model.lora_rank 8] [--trainer.max_steps 200] [--model.export OUT_DIR] \\
        [--data.pack true] [--data.seq_len 64] [--data.val_documents VAL.jsonl]
    python examples/finetune_lm.py fit ... --data.documents a.jsonl:0.7,b.jsonl:0.3 \\
        [--data.weights_from "1000:0.5,0.5"]   # other weights from step 1000 on
    python examples/finetune_lm.py validate --model.pretrained DIR --data.documents ... \\
        --data.val_documents VAL.jsonl

``DIR`` is a folder ``transformers``' ``LlamaForCausalLM.save_pretrained`` wrote
(``config.json`` and safetensors, sharded or not); ``FILE.jsonl`` holds one
``{"input_ids": [...]}`` per document. Documents go one per row of
``--data.seq_len`` tokens, padded, or with ``--data.pack true`` packed several
per row (grain's first-fit packing), each with its own positions and an
attention that never crosses into another document; a document longer than a
row goes on in the next. The loss is the mean next-token cross-entropy over
every predicted token of the global batch (`jl.metrics.TokenMean`), the same
number packed or padded, and what ``transformers`` computes per document. Several
sources mix by weight (each packed apart, rows drawn by weight), their tokens
counted in ``data/tokens/<source>``; a stopped run resumes at the exact row.

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
    """Rotary position embedding as transformers' Llama applies it (halves
    rotated); ``positions`` ``(batch, seq)`` restart at 0 in each document."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(0, half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # (batch, seq, half)
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
    heads: int
    kv_heads: int
    head_dim: int
    theta: float

    @nn.compact
    def __call__(self, x, positions, segments):
        b, t, _ = x.shape
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)  # noqa: E731
        q = dense(self.heads * self.head_dim, "q_proj")(x).reshape(b, t, self.heads, -1)
        k = dense(self.kv_heads * self.head_dim, "k_proj")(x).reshape(b, t, self.kv_heads, -1)
        v = dense(self.kv_heads * self.head_dim, "v_proj")(x).reshape(b, t, self.kv_heads, -1)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        repeat = self.heads // self.kv_heads  # grouped-query: each kv head serves `repeat`
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(q.dtype)
        # causal, and within one document: packed documents never see each other
        same = segments[:, :, None] == segments[:, None, :]
        allowed = jnp.tril(jnp.ones((t, t), bool)) & same
        scores = jnp.where(allowed[:, None], scores, jnp.finfo(scores.dtype).min)
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
    def __call__(self, x, positions, segments):
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 1e4)
        attention = Attention(c["num_attention_heads"], kv_heads, head_dim, theta, name="self_attn")
        normed = RMSNorm(c["rms_norm_eps"], name="input_layernorm")(x)
        x = x + attention(normed, positions, segments)
        mlp = Mlp(c["intermediate_size"], name="mlp")
        return x + mlp(RMSNorm(c["rms_norm_eps"], name="post_attention_layernorm")(x))


class Llama(nn.Module):
    """``LlamaForCausalLM``'s computation, from its ``config.json`` (as a dict)."""

    config: dict

    @nn.compact
    def __call__(self, tokens, positions=None, segments=None):
        """Logits for ``tokens`` ``(batch, seq)``; with packed rows, each token's
        ``positions`` in its document and its document's ``segments`` id."""
        c = self.config
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if segments is None:
            segments = jnp.ones_like(tokens)
        embed = nn.Embed(c["vocab_size"], c["hidden_size"], name="embed_tokens")
        x = embed(tokens)
        for i in range(c["num_hidden_layers"]):
            x = Block(c, name=f"layers_{i}")(x, positions, segments)
        x = RMSNorm(c["rms_norm_eps"], name="norm")(x)
        if c.get("tie_word_embeddings"):
            return embed.attend(x)
        return nn.Dense(c["vocab_size"], use_bias=False, name="lm_head")(x)


def next_token_loss(logits, tokens):
    """Mean cross-entropy of each row's predictions of its next tokens (rows
    of one document each, no padding)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]
    )
    return losses.mean(-1)


def token_losses(logits, batch):
    """Each position's loss predicting the next token, and whether it counts:
    the next token is in the same document (not padding, not the next document)."""
    tokens, segments = batch["input_ids"], batch["segment_ids"]
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]
    )
    counts = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    return losses, counts


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

    @property
    def source_names(self) -> list[str]:
        """The data's sources (``data/tokens/<name>`` counts their tokens)."""
        try:
            return list(getattr(self.trainer.datamodule, "source_names", []))
        except RuntimeError:  # not attached to a Trainer
            return []

    def _token_losses(self, variables, batch):
        logits = self.net.apply(
            variables, batch["input_ids"], batch["positions"], batch["segment_ids"]
        )
        return token_losses(logits, batch)

    def loss(self, variables, batch, rngs):
        losses, counts = self._token_losses(variables, batch)
        loss = jl.metrics.TokenMean(losses, counts)  # per token over the global batch
        self.log("train_loss", loss, prog_bar=True)
        for i, name in enumerate(self.source_names):  # the mixture this run got
            tokens = (batch["source"] == i) & (batch["segment_ids"] > 0)
            self.log(f"data/tokens/{name}", tokens.sum(-1), reduce_fx="sum", on_epoch=True)
        return loss

    def eval_step(self, variables, batch):
        losses, counts = self._token_losses(variables, batch)
        self.log("val_loss", jl.metrics.TokenMean(losses, counts), prog_bar=True)

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


def read_documents(path: str) -> list[np.ndarray]:
    """One token array per line of a JSON-lines file ``{"input_ids": [...]}``."""
    with open(path) as f:
        return [np.asarray(json.loads(line)["input_ids"], np.int32) for line in f if line.strip()]


def pieces(documents: list[np.ndarray], seq_len: int, source: int = 0) -> list[dict]:
    """Documents cut into pieces of at most ``seq_len`` tokens (a longer one
    goes on in the next piece, ``continued`` marking it), each a dict of
    per-token arrays: tokens, its source's index."""
    out = []
    for doc in documents:
        for start in range(0, len(doc), seq_len):
            chunk = doc[start : start + seq_len]
            out.append(
                {
                    "input_ids": chunk,
                    "source": np.full(len(chunk), source, np.int32),
                    "continued": np.full(len(chunk), start > 0, np.int32),
                }
            )
    return out


def padded_row(piece: dict, seq_len: int) -> dict:
    """One piece per row, padded to ``seq_len`` (segment 0 marks the padding)."""
    n = len(piece["input_ids"])
    pad = lambda a: np.pad(a, (0, seq_len - n))  # noqa: E731
    return {
        "input_ids": pad(piece["input_ids"]),
        "segment_ids": pad(np.ones(n, np.int32)),
        "positions": pad(np.arange(n, dtype=np.int32)),
        "source": pad(piece["source"]),
    }


def packed_rows(dataset, seq_len: int, seed: int):
    """Pieces packed first-fit into rows of ``seq_len`` tokens by grain, with
    per-document segment ids (1, 2, ...; 0: padding) and positions from 0."""
    import grain.experimental

    lengths = {"input_ids": seq_len, "source": seq_len, "continued": seq_len}
    packed = grain.experimental.FirstFitPackIterDataset(
        dataset, length_struct=lengths, num_packing_bins=8, seed=seed,
        meta_features=("source", "continued"),
    )  # fmt: skip
    return packed.map(
        lambda r: {
            "input_ids": r["input_ids"],
            "segment_ids": r["input_ids_segment_ids"],
            "positions": r["input_ids_positions"],
            "source": r["source"],
        }
    )


class Documents(jl.DataModule):
    """Token documents as rows of ``seq_len`` for a language model, through grain.

    ``documents`` is one JSON-lines file, or a mixture ``a.jsonl:0.7,b.jsonl:0.3``
    (each source packed apart, rows drawn by weight, deterministic for ``seed``);
    ``weights_from`` changes the weights at given steps: ``"1000:0.5,0.5;2000:0.2,0.8"``.
    ``pack`` packs several documents per row (first fit), else one per row,
    padded. Validation reads ``val_documents``, else the last ``val_fraction``
    of each source's documents (held out of training). Training streams rows
    without end (``trainer.max_steps`` ends the fit) and resumes exactly from
    grain's iterator state.
    """

    def __init__(
        self,
        documents: str,
        seq_len: int = 64,
        batch_size: int = 8,
        pack: bool = False,
        val_documents: str | None = None,
        val_fraction: float = 0.1,
        seed: int = 0,
        weights_from: str | None = None,
    ):
        self.seq_len, self.batch_size, self.pack = seq_len, batch_size, pack
        self.weights_from = weights_from
        self.val_documents, self.val_fraction, self.seed = val_documents, val_fraction, seed
        self.sources = []  # (name, path, weight)
        for part in documents.split(","):
            path, _, weight = part.partition(":") if part.count(":") else (part, "", "1")
            name = os.path.splitext(os.path.basename(path))[0]
            self.sources.append((name, path, float(weight or 1)))

    @property
    def source_names(self) -> list[str]:
        return [name for name, _, _ in self.sources]

    def setup(self, stage: str) -> None:
        self.train_docs, val = [], []
        for _, path, _ in self.sources:
            docs = read_documents(path)
            held = 0 if self.val_documents else max(1, int(len(docs) * self.val_fraction))
            self.train_docs.append(docs[: len(docs) - held])
            val += docs[len(docs) - held :]
        self.val_docs = read_documents(self.val_documents) if self.val_documents else val

    def _rows(self, docs, source, *, train):
        import grain

        data = grain.MapDataset.source(pieces(docs, self.seq_len, source))
        if train:
            data = data.shuffle(self.seed + source).repeat()
        data = data.to_iter_dataset()
        if self.pack:
            return packed_rows(data, self.seq_len, self.seed)
        return data.map(lambda piece: padded_row(piece, self.seq_len))

    def train_dataloader(self):
        streams = [self._rows(d, i, train=True) for i, d in enumerate(self.train_docs)]
        if len(streams) == 1:
            return streams[0].batch(self.batch_size)
        schedule = [(0, [weight for _, _, weight in self.sources])]
        for phase in (self.weights_from or "").split(";"):
            if phase.strip():  # "STEP:W1,W2,...": these weights from that step on
                step, _, weights = phase.partition(":")
                schedule.append((int(step), [float(w) for w in weights.split(",")]))
        rows = jl.scheduled_mixture(
            streams, schedule, rows_per_step=self.batch_size, seed=self.seed
        )
        return rows.batch(self.batch_size)

    def val_dataloader(self):
        return self._rows(self.val_docs, 0, train=False).batch(self.batch_size)


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
