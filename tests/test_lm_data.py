"""Language-model data: a loss per token exact over the global batch
(`jl.metrics.TokenMean`), documents packed with their own segments and
positions, mixtures by weight, and exact resume (examples/finetune_lm.py)."""

import itertools
import json
import os
import subprocess
import sys
import tempfile

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxlightning as jl
from tests.helpers import load_example, quiet_trainer
from tests.test_weights import tiny_llama

RNG = np.random.default_rng(0)
TABLE = RNG.normal(size=(16, 16)).astype(np.float32) * 0.1


# ------------------------------------------------------- the loss per token
class TokenModel(jl.JaxModule):
    """A bigram model (an embedding of the logits) trained by the mean token loss."""

    def setup(self, rng, batch):
        return {"params": {"table": jnp.asarray(TABLE)}}

    def configure_optimizers(self):
        return optax.sgd(1.0)

    def loss(self, variables, batch, rngs):
        return jl.metrics.TokenMean(*bigram_losses(variables["params"]["table"], batch))

    def eval_step(self, variables, batch):
        self.log(
            "val_loss", jl.metrics.TokenMean(*bigram_losses(variables["params"]["table"], batch))
        )


def bigram_losses(table, batch):
    logits = table[batch["tokens"][:, :-1]]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return losses, batch["counts"][:, 1:] > 0


def token_rows(n):
    tokens = RNG.integers(0, 16, (n, 12)).astype(np.int32)
    lengths = RNG.integers(2, 13, n)
    counts = (np.arange(12)[None] < lengths[:, None]).astype(np.int32)
    return [{"tokens": t, "counts": c} for t, c in zip(tokens, counts, strict=True)]


def test_a_token_mean_loss_is_the_mean_over_every_token_of_the_global_batch():
    rows = token_rows(20)  # 8 devices: a batch of 20 is padded to 24 rows
    loader = torch.utils.data.DataLoader(rows, batch_size=20)
    module = TokenModel()
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, loader)
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def global_mean(t):  # every counted token of the batch, in one mean
        losses, counted = bigram_losses(t, batch)
        return jnp.where(counted, losses, 0).sum() / counted.sum()

    expected = TABLE - jax.grad(global_mean)(TABLE)
    np.testing.assert_allclose(trainer.state.params["table"], expected, atol=1e-6)
    (result,) = trainer.validate(module, loader)
    assert result["val_loss"] == pytest.approx(
        float(global_mean(trainer.state.params["table"])), rel=1e-5
    )


def test_a_token_mean_names_a_mask_that_does_not_fit():
    with pytest.raises(ValueError, match="values of shape \\(2, 3\\) and mask of shape \\(2, 4\\)"):
        jl.metrics.TokenMean(np.zeros((2, 3)), np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="give booleans"):
        jl.metrics.TokenMean(np.zeros((2, 3)), np.ones((2, 3), np.float32))


# ----------------------------------------------------------------- packing
def documents(n, low=3, high=40):
    return [RNG.integers(0, 64, int(RNG.integers(low, high))).astype(np.int32) for _ in range(n)]


def test_packed_rows_hold_every_token_once_with_positions_restarting_per_document():
    example = load_example("finetune_lm")
    docs = documents(30)
    data = grain.MapDataset.source(example.pieces(docs, 16)).to_iter_dataset()
    rows = list(example.packed_rows(data, 16, seed=0))
    seen = []
    for row in rows:
        for segment in sorted(set(row["segment_ids"].tolist()) - {0}):
            where = row["segment_ids"] == segment
            np.testing.assert_array_equal(row["positions"][where], np.arange(where.sum()))
            seen.append(row["input_ids"][where].tolist())
    expected = [p["input_ids"].tolist() for p in example.pieces(docs, 16)]
    assert sorted(seen) == sorted(expected)  # every piece once, whole
    assert len(rows) < len(expected)  # several documents share rows


def test_a_document_longer_than_a_row_goes_on_in_the_next_piece_marked_continued():
    example = load_example("finetune_lm")
    (first, second, third) = example.pieces([np.arange(40, dtype=np.int32)], 16)
    np.testing.assert_array_equal(
        np.concatenate([first["input_ids"], second["input_ids"], third["input_ids"]]), np.arange(40)
    )
    assert (first["continued"] == 0).all() and (third["continued"] == 1).all()


def test_attention_never_crosses_packed_documents():
    example = load_example("finetune_lm")
    config = {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    net = example.Llama(config)
    docs = documents(3, 6, 7)  # one length: one compile for the documents alone
    data = grain.MapDataset.source(example.pieces(docs, 24)).to_iter_dataset()
    (row,) = list(example.packed_rows(data, 24, seed=0))
    variables = net.init(jax.random.key(0), row["input_ids"][None])
    apply = jax.jit(net.apply)
    packed = apply(variables, row["input_ids"][None], row["positions"][None],
                   row["segment_ids"][None])[0]  # fmt: skip
    for segment in (1, 2, 3):
        where = row["segment_ids"] == segment
        alone = apply(variables, row["input_ids"][where][None])[0]
        np.testing.assert_allclose(packed[where], alone, atol=1e-5)


# ----------------------------------------------------- the example, end to end
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    hf = tiny_llama(str(root / "llama"))
    rng = np.random.default_rng(2)
    for name, n, high in (("val", 30, 60), ("a", 150, 100), ("b", 150, 100)):
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                ids = rng.integers(0, 64, int(rng.integers(5, high))).tolist()
                f.write(json.dumps({"input_ids": ids}) + "\n")
    return hf, root


def cli(root, subcommand, *args):
    argv = [
        subcommand, "--model.pretrained", str(root / "llama"),
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
        tempfile.mkdtemp(dir=root), *args,
    ]  # fmt: skip
    return load_example("finetune_lm").main(argv)


def hf_token_mean(hf, path):
    total = count = 0.0
    with open(path) as f, torch.no_grad():
        for line in f:
            ids = torch.tensor([json.loads(line)["input_ids"]])
            total += hf(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["true", "false"])
def test_validation_loss_is_transformers_mean_over_every_token(corpus, pack):
    hf, root = corpus
    run = cli(root, "validate", "--data.documents", str(root / "a.jsonl"),
              "--data.val_documents", str(root / "val.jsonl"), "--data.pack", pack,
              "--data.seq_len", "64", "--trainer.logger", "false")  # fmt: skip
    got = run.trainer.callback_metrics["val_loss"]
    assert abs(got - hf_token_mean(hf, root / "val.jsonl")) < 1e-4


MIXED = ["--data.pack", "true", "--trainer.log_every_n_steps", "10", "--model.lr", "1e-2"]


def mixture(root):
    return ["--data.documents", f"{root / 'a.jsonl'}:0.7,{root / 'b.jsonl'}:0.3"]


@pytest.mark.slow
def test_a_packed_mixture_resumed_mid_stream_is_bitwise_the_uninterrupted_run(corpus):
    _, root = corpus
    straight = cli(root, "fit", *mixture(root), *MIXED, "--trainer.max_steps", "40")
    every = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=20",
             "--trainer.callbacks.save_top_k=-1"]  # fmt: skip
    first = cli(root, "fit", *mixture(root), *MIXED, "--trainer.max_steps", "20", *every)
    checkpoint = first.trainer.checkpoint_callback.last_model_path or os.path.join(
        first.trainer.checkpoint_callback.dirpath, "20"
    )
    resumed = cli(root, "fit", *mixture(root), *MIXED, "--trainer.max_steps", "40",
                  "--ckpt_path", checkpoint)  # fmt: skip
    for a, b in zip(jax.tree.leaves(straight.trainer.state.params),
                    jax.tree.leaves(resumed.trainer.state.params), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    metrics = straight.trainer.callback_metrics  # each source's tokens over the run
    a, b = metrics["data/tokens/a_epoch"], metrics["data/tokens/b_epoch"]
    assert a + b > 40 * 8 * 64 * 0.8  # nearly full rows
    share = a / (a + b)
    assert abs(share - 0.7) < 0.05 * 0.7  # within 5% of the weight
    # on 4 devices instead of 8, from the same checkpoint: the same rows, to float tolerance
    out = os.path.join(root, "four.npz")
    script = (
        "import sys, numpy as np, jax; sys.path.insert(0, '.');"
        "from tests.test_lm_data import cli; import pathlib;"
        f"run = cli(pathlib.Path({str(root)!r}), 'fit', *{mixture(root) + MIXED!r},"
        f"'--trainer.max_steps', '40', '--ckpt_path', {checkpoint!r});"
        f"np.savez({out!r}, *[np.asarray(x) for x in jax.tree.leaves(run.trainer.state.params)])"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as four:
        for i, b in enumerate(jax.tree.leaves(straight.trainer.state.params)):
            np.testing.assert_allclose(four[f"arr_{i}"], np.asarray(b), atol=1e-4)


# ------------------------------------------------------------------ mixtures
def numbered(start):
    return grain.MapDataset.source(list(range(start, start + 10_000))).repeat().to_iter_dataset()


def test_a_scheduled_mixture_draws_by_the_weights_in_force_and_resumes_at_the_row():
    mixed = jl.scheduled_mixture(
        [numbered(0), numbered(100_000)], [(0, [0.8, 0.2]), (50, [0.1, 0.9])], rows_per_step=8
    )
    rows = list(itertools.islice(iter(mixed), 800))
    second = np.array([r >= 100_000 for r in rows])
    assert abs(second[:400].mean() - 0.2) < 0.05 and abs(second[400:].mean() - 0.9) < 0.05
    assert rows == list(itertools.islice(iter(mixed), 800))  # deterministic for its seed
    stopped = iter(mixed)
    list(itertools.islice(stopped, 333))
    resumed = iter(mixed)
    resumed.set_state(json.loads(json.dumps(stopped.get_state())))  # as a checkpoint holds it
    assert list(itertools.islice(resumed, 100)) == rows[333:433]


def test_a_mixture_schedule_that_cannot_be_followed_is_named():
    with pytest.raises(ValueError, match="the first at step 0"):
        jl.scheduled_mixture([numbered(0)], [(5, [1.0])], rows_per_step=1)
    with pytest.raises(ValueError, match="give 2 non-negative weights"):
        jl.scheduled_mixture([numbered(0), numbered(9)], [(0, [1.0])], rows_per_step=1)
