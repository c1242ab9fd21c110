"""The language-model data arm: real tokens per second, packed against padded
rows and against a bare ``jax.jit`` loop over the same packed arrays (already
on the device: the bare loop pays nothing for its data).

A small Llama of examples/finetune_lm.py (random weights, written to a folder
as ``save_pretrained`` would) trains on documents of 8 to ``SEQ`` tokens: one
per row padded to ``SEQ`` (padding to the longest), or packed first-fit. A fit
of ``2 * steps`` is timed over its last ``steps`` batches (after the compile),
and its real tokens are those batches'.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxlightning as jl

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 256, 8
CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}  # fmt: skip


def _example() -> Any:
    if "finetune_lm" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "finetune_lm", ROOT / "examples" / "finetune_lm.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["finetune_lm"] = module
        spec.loader.exec_module(module)
    return sys.modules["finetune_lm"]


def _model(root: str) -> str:
    """A pretrained folder: config and safetensors."""
    example = _example()
    folder = os.path.join(root, "model")
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    variables = example.Llama(CONFIG).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    jl.save_weights(variables, folder, rename=example.HF_LLAMA)
    return folder


def _documents(root: str, count: int, lengths: str) -> str:
    """Documents of ``uniform`` lengths (8 to ``SEQ``), or a ``long_tail``
    (exponential, mean ``SEQ / 4``, within 8 to ``SEQ``: most short, a few long,
    as real corpora are)."""
    rng = np.random.default_rng(0)
    if lengths == "uniform":
        sizes = rng.integers(8, SEQ + 1, count)
    else:
        sizes = np.clip(rng.exponential(SEQ / 4, count), 8, SEQ).astype(int)
    path = os.path.join(root, f"{lengths}.jsonl")
    with open(path, "w") as f:
        for size in sizes:
            ids = rng.integers(0, CONFIG["vocab_size"], int(size))
            f.write(json.dumps({"input_ids": ids.tolist()}) + "\n")
    return path


def _data(path: str, pack: bool) -> Any:
    data = _example().Documents(path, seq_len=SEQ, batch_size=BATCH, pack=pack, val_fraction=0)
    data.setup("fit")
    return data


class _Prepacked:
    """The packed batches computed once, as a datamodule (the Trainer's own
    cost on the same arrays the bare loop trains on, without the packing)."""

    def __init__(self, data: Any, batches: int) -> None:
        import grain

        stream = iter(data.train_dataloader())
        rows = [row for _ in range(batches) for row in _rows(next(stream))]
        self.loader = grain.MapDataset.source(rows).batch(BATCH)

    def train_dataloader(self) -> Any:
        return self.loader


def _rows(batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    return [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]


def _real_tokens(data: Any, start: int, stop: int) -> int:
    batches = iter(data.train_dataloader())
    counts = [int((next(batches)["segment_ids"] > 0).sum()) for _ in range(stop)]
    return sum(counts[start:])


class _Clock(jl.Callback):
    """When each trained batch ended (the steps of a dispatch end together)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: Any, module: Any) -> None:
        jax.block_until_ready(trainer.state.params)
        self.ends[-1] = time.perf_counter()


def _fit_seconds(folder: str, data: Any, warm: int, steps: int) -> float:
    """Seconds the Trainer takes for batches ``warm`` to ``steps`` of a fit
    (after the first ``warm``: the compile and the first dispatches)."""
    module = _example().FineTuneLM(folder, lora_rank=0, lr=1e-3)
    clock = _Clock()
    trainer = jl.Trainer(
        max_steps=steps, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[clock],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return clock.ends[-1] - clock.ends[warm - 1]


def _bare_seconds(folder: str, data: Any, steps: int) -> float:
    """The same model and loss in a hand-written jit loop over the packed
    batches, already on the device: ``2 * steps`` timed against ``steps``."""
    example = _example()
    net = example.Llama(CONFIG)
    variables = jl.load_weights(
        folder,
        jax.eval_shape(net.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)),
        rename=example.HF_LLAMA,
    )
    tx = optax.adamw(1e-3, weight_decay=0.0)

    def loss(params, batch):
        logits = net.apply({"params": params}, batch["input_ids"], batch["positions"],
                           batch["segment_ids"])  # fmt: skip
        losses, counts = example.token_losses(logits, batch)
        return jnp.where(counts, losses, 0).sum() / counts.sum()

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    batches = iter(data.train_dataloader())
    placed = [jax.device_put(next(batches)) for _ in range(2 * steps)]
    params, opt_state = variables["params"], tx.init(variables["params"])
    params, opt_state = step(params, opt_state, placed[0])  # compiled
    jax.block_until_ready(params)
    times = []
    for count in (steps, 2 * steps):
        start = time.perf_counter()
        for batch in placed[:count]:
            params, opt_state = step(params, opt_state, batch)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    return times[1] - times[0]


def packing(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Real tokens per second: packed vs padded rows (Trainer), packed Trainer
    vs a bare jit loop over the same packed batches; for documents of uniform
    lengths and of long-tailed ones."""
    steps = max(4, size["steps"] // 2)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        folder = _model(root)
        # a smoke run (--quick) checks one case: the arm's parts all run
        cases = ("long_tail", "uniform") if size["steps"] >= 32 else ("long_tail",)
        for lengths in cases:
            path = _documents(root, max(64, 8 * steps * BATCH), lengths)
            out[lengths] = _compare(folder, path, steps, rounds)
    return out


def _compare(folder: str, path: str, steps: int, rounds: int) -> dict[str, float]:
    packed, padded = _data(path, True), _data(path, False)
    tokens = {
        "packed": _real_tokens(packed, steps, 2 * steps),
        "padded": _real_tokens(padded, steps, 2 * steps),
    }
    prepacked = _Prepacked(packed, 2 * steps)
    tokens["prepacked"] = tokens["packed"]
    rates: dict[str, list[float]] = {"packed": [], "padded": [], "prepacked": [], "bare": []}
    for _ in range(rounds):
        for name, data in (("packed", packed), ("padded", padded), ("prepacked", prepacked)):
            rates[name].append(tokens[name] / _fit_seconds(folder, data, steps, 2 * steps))
        rates["bare"].append(tokens["packed"] / _bare_seconds(folder, packed, steps))
    median = {name: float(np.median(r)) for name, r in rates.items()}
    return {
        "packed_tokens_per_s": median["packed"],
        "padded_tokens_per_s": median["padded"],
        "prepacked_tokens_per_s": median["prepacked"],
        "bare_packed_tokens_per_s": median["bare"],
        "packed_over_padded": median["packed"] / median["padded"],
        # the Trainer on the same packed arrays as the bare loop: its own cost
        "prepacked_over_bare": median["prepacked"] / median["bare"],
        # packing on the fly included (on these 2 cores it competes with XLA)
        "packed_over_bare": median["packed"] / median["bare"],
        "real_token_share_packed": tokens["packed"] / (steps * BATCH * SEQ),
        "real_token_share_padded": tokens["padded"] / (steps * BATCH * SEQ),
    }
