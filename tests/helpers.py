"""Shared models, data and independent (numpy) reference computations."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import jaxlightning as jl
from jaxlightning.io.weight_sources import Source


class CompileCounter:
    """A jax.monitoring listener counting backend compilations per function."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.threads: dict[str, list[str]] = {}  # function -> the threads that compiled it

    def __call__(self, event: str, duration: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            name = str(kwargs.get("fun_name", ""))
            self.counts[name] += 1
            self.threads.setdefault(name, []).append(threading.current_thread().name)

    def reset(self) -> None:
        self.counts.clear()
        self.threads.clear()

    def matching(self, fragment: str) -> int:
        return sum(n for name, n in self.counts.items() if fragment in name)


class MLP(nn.Module):
    hidden: int = 32
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        for _ in range(2):
            x = nn.relu(nn.Dense(self.hidden)(x))
            if self.dropout:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(10)(x)


class LitMLP(jl.JaxModule):
    """An MLP classifier on batches ``(x, y)``; optionally with fixed initial variables."""

    def __init__(self, hidden=32, lr=1e-2, dropout=0.0, init_variables=None, scalar_loss=False):
        super().__init__()
        self.save_hyperparameters(ignore=("init_variables",))
        self.net = MLP(hidden, dropout)
        self.init_variables = init_variables

    def setup(self, rng, batch):
        if self.init_variables is not None:
            return self.init_variables
        return self.net.init(rng, batch[0])

    def configure_optimizers(self):
        return optax.sgd(self.hparams.lr) if self.hparams.lr == 0 else optax.adam(self.hparams.lr)

    def loss(self, variables, batch, rngs):
        x, y = batch
        logits = self.net.apply(variables, x, train=True, rngs=rngs)
        self.log("acc", logits.argmax(-1) == y)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return per_example.mean() if self.hparams.scalar_loss else per_example

    def eval_step(self, variables, batch):
        x, y = batch
        logits = self.net.apply(variables, x)
        self.log("loss", optax.softmax_cross_entropy_with_integer_labels(logits, y))
        self.log("acc", logits.argmax(-1) == y)

    def predict_step(self, variables, batch):
        return {"logits": self.net.apply(variables, batch[0])}


def digits(n: int | None = None, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    end = None if n is None else offset + n
    return x[offset:end], y[offset:end]


def loader(x, y, batch_size, shuffle=False, seed=0) -> DataLoader:
    ds = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=gen)


def init_mlp(hidden=32, seed=0) -> dict:
    return MLP(hidden).init(jax.random.PRNGKey(seed), np.zeros((1, 64), np.float32))


def np_logits(params, x) -> np.ndarray:
    """The MLP's forward pass in float64 numpy."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    h = np.asarray(x, np.float64)
    for i in range(2):
        h = np.maximum(h @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"], 0)
    return h @ p["Dense_2"]["kernel"] + p["Dense_2"]["bias"]


def np_cross_entropy(logits, y) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    return lse - logits[np.arange(len(y)), y]


def quiet_trainer(**kwargs) -> jl.Trainer:
    """A Trainer with no bar, logger or summary, and no checkpoints unless
    ``callbacks`` has a `ModelCheckpoint` (Lightning refuses one with
    ``enable_checkpointing=False``). Names logged in traced steps carry their
    stage (``stage_prefix=True``: ``train/acc`` and ``val/acc`` stay apart in
    tests of other features), and what ``loss()`` returns is reported as
    ``train/loss`` (``log_loss=True``); tests of naming, and the translations
    of Lightning's tests, pass ``stage_prefix=False, log_loss=False`` (the
    defaults of `Trainer`)."""
    callbacks = kwargs.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("logger", False)
    kwargs.setdefault(
        "enable_checkpointing", any(isinstance(c, jl.ModelCheckpoint) for c in callbacks)
    )
    kwargs.setdefault("enable_model_summary", False)
    kwargs.setdefault("stage_prefix", True)
    kwargs.setdefault("log_loss", True)
    return jl.Trainer(**kwargs)


def lightning_trainer(**kwargs) -> jl.Trainer:
    """`quiet_trainer` with only what the module logs reported, as logged (the
    Trainer's defaults, Lightning's rules): for the translations of Lightning's
    own tests."""
    return quiet_trainer(**{"stage_prefix": False, "log_loss": False, **kwargs})


def max_abs_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def nnx_mlp_module(init_variables, lr=1e-2) -> jl.JaxModule:
    """`LitMLP` written in NNX, starting from linen ``init_variables``: its
    layers are named as linen names them, so the two train to the same arrays."""
    import jax.numpy as jnp
    from flax import nnx

    class NnxMLP(nnx.Module):
        def __init__(self, params):
            rngs = nnx.Rngs(0)
            for name in ("Dense_0", "Dense_1", "Dense_2"):
                fan_in, fan_out = params[name]["kernel"].shape
                layer = nnx.Linear(fan_in, fan_out, rngs=rngs)
                layer.kernel = nnx.Param(jnp.asarray(params[name]["kernel"]))
                layer.bias = nnx.Param(jnp.asarray(params[name]["bias"]))
                setattr(self, name, layer)

        def __call__(self, x):
            x = nnx.relu(self.Dense_0(x))
            return self.Dense_2(nnx.relu(self.Dense_1(x)))

    class LitNnxMLP(jl.JaxModule):
        def __init__(self):
            super().__init__()
            self.model = NnxMLP(init_variables["params"])

        def configure_optimizers(self):
            return optax.adam(lr)

        def loss(self, model, batch):
            x, y = batch
            logits = model(x)
            self.log("acc", logits.argmax(-1) == y)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

        def eval_step(self, model, batch):
            x, y = batch
            logits = model(x)
            self.log("loss", optax.softmax_cross_entropy_with_integer_labels(logits, y))
            self.log("acc", logits.argmax(-1) == y)

        def predict_step(self, model, batch):
            return {"logits": model(batch[0])}

    return LitNnxMLP()


def load_example(name: str):
    """``examples/<name>.py`` as the module ``example_<name>`` (loaded once)."""
    import importlib.util
    import sys
    from pathlib import Path

    module_name = f"example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # flax modules are dataclasses: they need it
    spec.loader.exec_module(module)
    return module


def trained_params(trainer) -> dict:
    """The trainer's parameters as host numpy arrays."""
    return jax.tree.map(np.asarray, trainer.state.params)


def assert_bitwise_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def bucket_fit(root, *, max_steps=-1, ckpt_path=None, logger=True) -> jl.Trainer:
    """The object-storage tests' run (S3 and GCS): 3 epochs of 200 digits in
    batches of 32, the 2 best by val/loss kept, TensorBoard and CSV in ``root``."""
    x, y = digits(200)
    vx, vy = digits(45, offset=1000)
    checkpoint = jl.ModelCheckpoint(monitor="val/loss", save_top_k=2)
    trainer = jl.Trainer(
        stage_prefix=True,  # train/acc and val/acc apart (TensorBoard tags checked)
        max_epochs=3,
        max_steps=max_steps,
        default_root_dir=root,
        logger=[jl.TensorBoardLogger(root), jl.CSVLogger(root)] if logger else False,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
    )
    module = LitMLP(lr=1e-2, init_variables=init_mlp())
    trainer.fit(module, loader(x, y, 32, shuffle=True), loader(vx, vy, 16), ckpt_path=ckpt_path)
    return trainer


def two_process_job(*args, **popen) -> Any:
    """``tests/run_multihost.py`` as a 2-process x 4-device job (the launcher):
    run to its end, or, with ``popen`` keywords, started (a `subprocess.Popen`)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable, "-m", "jaxlightning.launch", "--nprocs", "2", "--devices-per-proc", "4",
        os.path.join(root, "tests", "run_multihost.py"), *map(str, args),
    ]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": ""}
    if popen:
        return subprocess.Popen(cmd, cwd=root, env=env, text=True, **popen)
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def job_params(npz_path) -> dict:
    """The final params a `two_process_job` wrote (``--out``), as nested dicts."""
    params: dict = {}
    with np.load(npz_path) as f:
        for key in (k for k in f.files if k.startswith("[")):
            group, name = (part.strip("[]'") for part in key.split("]["))
            params.setdefault(group, {})[name] = f[key]
    assert sum(len(v) for v in params.values()) == 6  # the MLP's 3 kernels and 3 biases
    return params


def fsdp_digits_params(ckpt_path=None) -> dict:
    """``run_multihost.py``'s training (2 epochs, global batch 64, FSDP) on this
    process's 8 devices, from ``ckpt_path`` if given: its final params."""
    x, y = digits(200)
    trainer = jl.Trainer(
        max_epochs=2, strategy="fsdp", logger=False, enable_progress_bar=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(LitMLP(lr=1e-2, init_variables=init_mlp()), loader(x, y, 64), ckpt_path=ckpt_path)
    return trained_params(trainer)


def assert_params_close(got: dict, expected: dict, atol: float = 1e-5) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


def fsdp_job_into(root: str, out: Any, save_every: int) -> tuple[str, list[int]]:
    """`two_process_job` training FSDP for 2 epochs with ``root`` as its run
    folder, checkpointing every ``save_every`` steps and writing its final
    params to ``out``: its checkpoint folder and the steps complete there."""
    from jaxlightning.io.checkpoint import complete_checkpoints

    job = two_process_job(
        "--root", root, "--strategy", "fsdp", "--epochs", "2", "--save-every", save_every,
        "--out", out,
    )  # fmt: skip
    assert job.returncode == 0, job.stdout[-3000:]
    ckpts = f"{root}/lightning_logs/version_0/checkpoints"
    return ckpts, [int(p.rsplit("/", 1)[1]) for p in complete_checkpoints(ckpts)]


class CountingSource(Source):
    """A weights source that records the size of every block read from it."""

    def __init__(self, inner):
        super().__init__(inner.where)
        self.inner, self.reads = inner, []

    def names(self):
        return self.inner.names()

    def read(self, name, index=None):
        block = self.inner.read(name, index)
        self.reads.append(int(block.size))
        return block
