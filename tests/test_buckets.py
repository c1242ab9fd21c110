"""Shape buckets (issue 42, item 1): variable-length examples padded by
`BucketCollate` to a few lengths compile the train step once per bucket, the
recompile guard stays quiet about them, and the metrics, masked by each
example's length, equal numpy's over the unpadded sequences."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import jaxlightning as jl
from tests.helpers import assert_bitwise_equal, quiet_trainer

BUCKETS = (8, 16, 32)
VOCAB, WIDTH = 12, 16


class Sequences(Dataset):
    """Token sequences of 2 to 30 tokens, in runs of 16 of short, middling and
    long ones (as a length-grouping sampler would batch them); the label is
    whether token 0 occurs more often than token 1."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        longest = [7, 15, 31]
        lengths = [rng.integers(2, longest[i // 16 % 3]) for i in range(n)]
        self.tokens = [rng.integers(0, VOCAB, k) for k in lengths]
        self.labels = [int((t == 0).sum() > (t == 1).sum()) for t in self.tokens]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return torch.from_numpy(self.tokens[i]), torch.tensor(self.labels[i])


class Bag(nn.Module):
    @nn.compact
    def __call__(self, tokens, lengths):
        real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        embedded = nn.Embed(VOCAB, WIDTH, name="embed")(tokens) * real[..., None]
        pooled = embedded.sum(1) / lengths[:, None]
        hidden = nn.relu(nn.Dense(WIDTH, name="hidden")(pooled))
        return nn.Dense(2, name="out")(hidden)


class LitBag(jl.JaxModule):
    def __init__(self):
        super().__init__()
        self.net = Bag()

    def setup(self, rng, batch):
        (tokens, _), lengths = batch
        return self.net.init(rng, tokens, lengths)

    def configure_optimizers(self):
        return optax.adam(1e-2)

    def _losses(self, variables, batch):
        (tokens, labels), lengths = batch
        logits = self.net.apply(variables, tokens, lengths)
        return logits, optax.softmax_cross_entropy_with_integer_labels(logits, labels), labels

    def loss(self, variables, batch, rngs):
        return self._losses(variables, batch)[1]

    def eval_step(self, variables, batch):
        logits, losses, labels = self._losses(variables, batch)
        self.log("loss", losses)
        self.log("acc", logits.argmax(-1) == labels)


def _loader(n, seed, batch_size=16):
    return DataLoader(
        Sequences(n, seed), batch_size=batch_size, collate_fn=jl.BucketCollate(BUCKETS)
    )


def _numpy_metrics(params, dataset):
    """Loss and accuracy over the unpadded sequences, in float64 numpy."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    losses, hits = [], []
    for tokens, label in zip(dataset.tokens, dataset.labels, strict=True):
        pooled = p["embed"]["embedding"][tokens].mean(0)
        hidden = np.maximum(pooled @ p["hidden"]["kernel"] + p["hidden"]["bias"], 0)
        logits = hidden @ p["out"]["kernel"] + p["out"]["bias"]
        log_z = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
        losses.append(log_z - logits[label])
        hits.append(logits.argmax() == label)
    return float(np.mean(losses)), float(np.mean(hits))


def test_buckets_compile_once_each_and_metrics_equal_unpadded_numpy(compiles):
    train, val = _loader(96, 0), _loader(40, 1)
    used = {tokens.shape[1] for (tokens, _), _ in train}  # the buckets its batches fill
    assert used == set(BUCKETS)

    trainer = quiet_trainer(max_epochs=2, recompile="raise", num_sanity_val_steps=0)
    module = LitBag()
    trainer.fit(module, train, val)  # "raise": any unexpected shape would stop it
    assert compiles.matching("train_step") == len(used)

    (result,) = trainer.validate(module, val)
    loss, acc = _numpy_metrics(trainer.state.params, val.dataset)
    assert result["val/loss"] == pytest.approx(loss, rel=1e-5)
    assert result["val/acc"] == pytest.approx(acc, abs=1e-7)


def test_buckets_with_several_steps_per_dispatch_train_as_one_step_each():
    def params(k):
        trainer = quiet_trainer(max_epochs=1, steps_per_execution=k, recompile="raise")
        trainer.fit(LitBag(), _loader(96, 0, batch_size=8))
        return trainer.state.params

    assert_bitwise_equal(params(4), params(1))


def test_a_sequence_longer_than_the_largest_bucket_is_named():
    collate = jl.BucketCollate((4, 8))
    with pytest.raises(ValueError, match=r"example of length 9 \(batch position 1\).*bucket, 8"):
        collate([np.arange(3), np.arange(9)])
    with pytest.raises(ValueError, match="must share their length, got lengths \\[3, 4\\]"):
        collate([(np.arange(3), np.arange(4))])
    # one size, not a list: named (it was a raw TypeError from set(); issue 61)
    with pytest.raises(TypeError, match=r"BucketCollate\(sizes=64\): expected a list.*\[64\]"):
        jl.BucketCollate(sizes=64)
