"""Shared pieces of the benchmark arms: data, models, the hand-written loops."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.jax_utils
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax.training import train_state
from torch.utils.data import DataLoader, Dataset, TensorDataset

import jaxlightning as jl

LR = 1e-3


class MLP(nn.Module):
    """The benchmark model: in -> 256 -> 256 -> 10 (digits: 64 inputs, MNIST: 784)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


class LitMLP(jl.JaxModule):
    def __init__(self):
        super().__init__()
        self.net = MLP()

    def setup(self, rng, batch):
        return self.net.init(rng, batch[0])

    def configure_optimizers(self):
        return optax.adam(LR)

    def loss(self, variables, batch, rngs):
        logits = self.net.apply(variables, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])

    def eval_step(self, variables, batch):
        logits = self.net.apply(variables, batch[0])
        self.log("acc", logits.argmax(-1) == batch[1])


def data(n: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)).astype(np.float32), rng.integers(0, 10, n)


class RowDataset(Dataset):
    """The same tensors behind a per-example ``__getitem__``, as most custom Datasets are.

    The Trainer fetches a `TensorDataset` a batch at a time; this one it cannot,
    so it measures the Trainer's own overhead on the loop's data path.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.tensors = (torch.from_numpy(x), torch.from_numpy(y))

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[0][i], self.tensors[1][i]


def loader(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    collate: Any = None,
    per_example: bool = False,
    **kwargs: Any,
) -> DataLoader:
    """``kwargs`` go to the DataLoader (``num_workers``, ...)."""
    ds = (
        RowDataset(x, y) if per_example else TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    )
    if collate is not None:
        kwargs["collate_fn"] = collate
    return DataLoader(ds, batch_size=batch_size, **kwargs)


def init_params(features: int, seed: int = 0) -> dict:
    return MLP().init(jax.random.PRNGKey(seed), np.zeros((1, features), np.float32))


class EpochTimes(jl.Callback):
    """Wall time of each training epoch, the device work of the epoch included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer, module) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module) -> None:
        jax.block_until_ready(trainer._program.held.live_state())
        self.times.append(time.perf_counter() - self._start)


def trainer_epochs(
    dl: DataLoader, epochs: int, callbacks: tuple = (), **trainer_kw: Any
) -> tuple[list[float], Any]:
    """Trainer.fit for ``epochs``; returns the epoch times and final params."""
    times = EpochTimes()
    trainer_kw.setdefault("logger", False)
    trainer_kw.setdefault("enable_checkpointing", False)
    trainer = jl.Trainer(
        max_epochs=epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[times, *callbacks],
        **trainer_kw,
    )
    module = LitMLP()
    module.variables = init_params(dl.dataset.tensors[0].shape[1])
    trainer.fit(module, dl)
    return times.times, jax.device_get(trainer.state.params)


def _adam_step(tx: Any) -> Any:
    """The bare loops' update: ``(params, opt_state, x, y) -> (params, opt_state)``."""
    net = MLP()

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = net.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def bare_jit_epochs(dl: DataLoader, epochs: int) -> tuple[list[float], Any]:
    """The hand-written baseline: one jitted step over the same DataLoader."""
    tx = optax.adam(LR)
    params = init_params(dl.dataset.tensors[0].shape[1])
    opt_state = tx.init(params)
    step = jax.jit(_adam_step(tx))

    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for x, y in dl:
            params, opt_state = step(params, opt_state, x.numpy(), y.numpy())
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    return times, jax.device_get(params)


def bare_jit_extras_epochs(
    dl: DataLoader, epochs: int, accumulate: int, clip: float, decay: float
) -> tuple[list[float], Any]:
    """A hand-written loop with gradient accumulation (summed over rows, one
    update every ``accumulate`` batches and at an epoch's end), clipping by
    global norm, and an EMA of the parameters: what the Trainer does with
    ``accumulate_grad_batches``, ``gradient_clip_val`` and the `EMA` callback."""
    net, tx = MLP(), optax.chain(optax.clip_by_global_norm(clip), optax.adam(LR))
    params = init_params(dl.dataset.tensors[0].shape[1])
    opt_state, ema = tx.init(params), params
    zeros = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def micro(gsum, params, x, y):
        def loss_sum(p):
            logits = net.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

        return jax.tree.map(jnp.add, gsum, jax.grad(loss_sum)(params))

    @jax.jit
    def update(params, opt_state, ema, gsum, rows):
        grads = jax.tree.map(lambda g: g / rows, gsum)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)
        return params, opt_state, ema

    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        gsum, rows, pending = zeros, 0, 0
        for x, y in dl:
            gsum = micro(gsum, params, x.numpy(), y.numpy())
            rows, pending = rows + len(x), pending + 1
            if pending == accumulate:
                params, opt_state, ema = update(params, opt_state, ema, gsum, rows)
                gsum, rows, pending = zeros, 0, 0
        if pending:
            params, opt_state, ema = update(params, opt_state, ema, gsum, rows)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    return times, jax.device_get(params)


def seeds_pmap_epochs(dl: DataLoader, epochs: int) -> tuple[list[float], Any]:
    """The seeds' hand-written pmap loop: replicate, reshape, host key splits, pmean."""
    n = jax.local_device_count()
    net = MLP()
    state = train_state.TrainState.create(
        apply_fn=net.apply,
        params=init_params(dl.dataset.tensors[0].shape[1])["params"],
        tx=optax.adam(LR),
    )

    def train_step(state, x, y, dropout_key):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x, rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.lax.pmean(jax.grad(loss_fn)(state.params), "batch")
        return state.apply_gradients(grads=grads)

    p_train_step = jax.pmap(train_step, "batch", donate_argnums=(0,))
    state = flax.jax_utils.replicate(state)
    key = jax.random.PRNGKey(0)
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for x, y in dl:
            xs = x.numpy().reshape(n, -1, *x.shape[1:])
            ys = y.numpy().reshape(n, -1)
            key, dropout_key = jax.random.split(key)
            dropout_keys = jax.random.split(dropout_key, n)
            state = p_train_step(state, xs, ys, dropout_keys)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return times, jax.device_get(jax.tree.map(lambda a: a[0], {"params": state.params}))


def steady(times: list[float]) -> float:
    """Median epoch time without the first (compiling) epoch."""
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def max_diff(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def interleave(rounds: int, arms: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Runs every arm once per round, in turn, so drift hits all arms alike."""
    results: dict[str, list[Any]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            results[name].append(arm())
    return results


def bare_resident_epochs(x: np.ndarray, y: np.ndarray, batch: int, epochs: int) -> list[float]:
    """The physical reference: the data on the device, each step one jitted call
    that gathers its rows there (a permutation per epoch, drawn on the host)."""
    tx = optax.adam(LR)
    params = init_params(x.shape[1])
    opt_state = tx.init(params)
    dx, dy = jax.device_put((x, y))
    update = _adam_step(tx)

    @jax.jit
    def step(params, opt_state, idx):
        return update(params, opt_state, dx[idx], dy[idx])

    times = []
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        start = time.perf_counter()
        order = rng.permutation(len(x)).astype(np.int32)
        for k in range(len(x) // batch):
            params, opt_state = step(params, opt_state, order[k * batch : (k + 1) * batch])
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    return times


def keras_available() -> bool:
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import keras  # noqa: F401
    except ImportError:
        return False
    return True


def keras_epochs(
    x: np.ndarray, y: np.ndarray, batch: int, epochs: int, steps_per_execution: int
) -> list[float]:
    """Keras 3 on JAX, ``model.fit`` on numpy arrays (``KERAS_BACKEND=jax``)."""
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError("set KERAS_BACKEND=jax before keras is imported")
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
        jit_compile=True,
    )

    class Times(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    times = Times()
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=True, verbose=0, callbacks=[times])
    return times.times
