"""Faults in the data pipeline and the train state that a user meets in a plain fit.

* DataLoader workers must start safely and cheaply: JAX is multithreaded, so a
  careless fork risks a deadlock (and JAX warns about it), while a forkserver
  imports the user's script again in every worker (~20 s, and a script without
  a main guard dies). The Trainer forks from a quiescent point.
* Persistent workers must persist: started once per fit, not once per epoch.
* A state handed to a callback must stay readable after later steps.

Worker processes started with "forkserver" import this module to unpickle
`record_worker_start`, so it imports only what they need at the top (torch,
pytest); JAX, flax and jaxlightning are imported inside the tests.
"""

import functools
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset


def record_worker_start(path: str, worker_id: int) -> None:
    """With the path bound by `functools.partial`, a `worker_init_fn` that appends
    one line per worker start: its pid, id and the objects its garbage
    collector holds frozen. (The path travels with the pickled function: an
    environment variable would not reach the children of a forkserver started
    earlier, which inherit the server's environment.)"""
    import gc

    with open(path, "a") as f:
        f.write(f"{os.getpid()} {worker_id} {gc.get_freeze_count()}\n")


def _digits_loader(batch_size: int, **kwargs) -> DataLoader:
    from tests.helpers import digits

    x, y = digits()
    ds = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    gen = torch.Generator().manual_seed(0)
    return DataLoader(ds, batch_size=batch_size, shuffle=True, generator=gen, **kwargs)


def _fit_params(loader: DataLoader, *, max_epochs: int):
    import jax

    from tests.helpers import LitMLP, init_mlp, quiet_trainer

    # the host path, where DataLoader workers load (a TensorDataset would
    # otherwise stay on the devices, and no worker would start)
    trainer = quiet_trainer(max_epochs=max_epochs, seed=0, data_on_device=False)
    trainer.fit(LitMLP(init_variables=init_mlp()), loader)
    assert trainer.data_path == "host"
    return jax.device_get(trainer.state.params)


def test_workers_fork_without_jax_warning_and_match_single_process_loading(capfd):
    """num_workers=2 and no multiprocessing_context: on Linux the Trainer forks
    the workers (as Lightning does; a forkserver would import the main script
    again) from a quiescent point, so JAX's fork warning is not raised, and the
    workers load exactly the batches the main process would, in the same order."""
    import jax

    reference = _fit_params(_digits_loader(128), max_epochs=1)
    capfd.readouterr()

    loader = _digits_loader(128, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = _fit_params(loader, max_epochs=1)
    err = capfd.readouterr().err

    if sys.platform.startswith("linux"):
        assert loader.multiprocessing_context.get_start_method() == "fork"
    forked = [str(w.message) for w in caught if "os.fork()" in str(w.message)]
    assert not forked, f"JAX warned about the workers' fork: {forked[0]}"
    assert "os.fork()" not in err, f"JAX warned about the workers' fork: {err}"
    leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(reference)
    assert len(leaves) == len(ref_leaves) == 6
    for leaf, ref in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))


def test_persistent_workers_are_started_once_per_fit(tmp_path):
    """persistent_workers=True over 3 epochs: 2 worker starts in all, not 2 per epoch."""
    starts = tmp_path / "starts.txt"
    loader = _digits_loader(
        256,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=functools.partial(record_worker_start, str(starts)),
    )
    _fit_params(loader, max_epochs=3)

    lines = starts.read_text().splitlines() if starts.exists() else []
    assert len(lines) == 2, f"expected 2 worker starts over 3 epochs, got {len(lines)}: {lines}"
    # forked: each worker froze what it inherited, so it never finalizes a JAX object
    assert all(int(line.split()[2]) > 1000 for line in lines), lines


@pytest.mark.slow
def test_a_forkserver_the_user_chooses_is_kept(tmp_path):
    """multiprocessing_context="forkserver" stays the workers' start method
    (persistent: started once, from the server)."""
    starts = tmp_path / "starts.txt"
    loader = _digits_loader(
        256,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="forkserver",
        worker_init_fn=functools.partial(record_worker_start, str(starts)),
    )
    _fit_params(loader, max_epochs=2)

    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    lines = starts.read_text().splitlines()
    assert len(lines) == 2, lines
    assert str(os.getpid()) not in {line.split()[0] for line in lines}


class _Rows(torch.utils.data.Dataset):
    """Rows fetched one at a time, slowly enough that the prefetch thread is
    still loading training batches when validation forks its workers."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


@pytest.mark.slow
def test_fifty_worker_starts_while_jax_runs_never_hang(tmp_path):
    """Non-persistent workers for training and validation, started anew every
    epoch while training steps and the prefetch thread run: >= 50 forks of the
    JAX process. A hung worker would make the DataLoader raise after its
    ``timeout``; the run must finish and match loading in the main process."""
    import jax

    from tests.helpers import LitMLP, digits, init_mlp, quiet_trainer

    x, y = digits(640)
    starts = tmp_path / "starts.txt"

    def loaders(workers: int) -> tuple[DataLoader, DataLoader]:
        kw = {}
        if workers:
            kw = {
                "num_workers": workers,
                "timeout": 120,
                "worker_init_fn": functools.partial(record_worker_start, str(starts)),
            }
        gen = torch.Generator().manual_seed(0)
        train = DataLoader(_Rows(x[:512], y[:512]), 64, shuffle=True, generator=gen, **kw)
        return train, DataLoader(_Rows(x[512:], y[512:]), 64, **kw)

    def fit(workers: int):
        trainer = quiet_trainer(max_epochs=13, seed=0)
        trainer.fit(LitMLP(init_variables=init_mlp()), *loaders(workers))
        return jax.device_get(trainer.state.params), trainer.callback_metrics["val/acc"]

    (params, acc), (ref_params, ref_acc) = fit(2), fit(0)
    lines = starts.read_text().splitlines()
    assert len(lines) >= 50, f"{len(lines)} worker starts"
    assert float(acc) == float(ref_acc)
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))


_UNGUARDED = """
import numpy as np, optax, torch
from torch.utils.data import DataLoader, Dataset
import jaxlightning as jl
from tests.helpers import LitMLP, digits

class Rows(Dataset):  # defined in the main script, as in a tutorial
    def __init__(self, x, y): self.x, self.y = x, y
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return torch.from_numpy(self.x[i]), int(self.y[i])

x, y = digits(512)
loader = DataLoader(Rows(x, y), batch_size=64, shuffle=True, num_workers=2{extra})
trainer = jl.Trainer(max_epochs=2, enable_progress_bar=False, logger=False,
                     enable_checkpointing=False, enable_model_summary=False)
trainer.fit(LitMLP(), loader, loader)
print("val acc", float(trainer.callback_metrics["acc"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_a_tutorial_script_with_workers_trains(tmp_path, guarded):
    """A script with DataLoader workers and a Dataset class of its own trains
    with and without an ``if __name__ == "__main__":`` guard (a forkserver or
    spawn worker would import it again: without the guard it dies)."""
    import subprocess

    body = _UNGUARDED.format(extra="")
    if guarded:
        head, _, rest = body.partition("x, y = digits(512)")
        body = (
            head
            + "def main():\n"
            + "".join(
                f"    {line}\n" for line in ("x, y = digits(512)" + rest).strip().splitlines()
            )
            + 'if __name__ == "__main__":\n    main()\n'
        )
    script = tmp_path / "tutorial.py"
    script.write_text(body)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    acc = float(done.stdout.split("val acc")[-1])
    assert 0.1 < acc <= 1.0
    assert "os.fork()" not in done.stderr


def test_state_read_in_a_callback_stays_valid_after_later_steps():
    """A state taken in a hook is a value: later steps must not delete its arrays."""
    import jax
    import jax.numpy as jnp

    import jaxlightning as jl
    from tests.helpers import LitMLP, digits, init_mlp, quiet_trainer

    class KeepFirstState(jl.Callback):
        """Stores ``trainer.state`` after the first step, with a host copy made then."""

        def __init__(self):
            self.state = self.copy = self.at_train_end = None

        def on_train_batch_end(self, trainer, module, batch_idx):
            if batch_idx == 0 and self.state is None:
                self.state = trainer.state
                # Copied on device first: reading the stored arrays to the host
                # directly would (on CPU) pin their buffers with a zero-copy
                # numpy view, which by itself keeps a donating step from
                # reusing them, and so would hide the fault.
                self.copy = jax.device_get(jax.tree.map(jnp.copy, self.state.params))

        def on_train_end(self, trainer, module):
            self.at_train_end = [np.asarray(a) for a in jax.tree.leaves(self.state.params)]

    x, y = digits(512)
    loader = DataLoader(
        TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=64, shuffle=False
    )
    keep = KeepFirstState()
    trainer = quiet_trainer(max_steps=4, seed=0, callbacks=[keep])
    trainer.fit(LitMLP(init_variables=init_mlp()), loader)

    assert int(jax.device_get(trainer.state.step)) == 4  # later steps did run
    copies = jax.tree.leaves(keep.copy)
    assert int(jax.device_get(keep.state.step)) == 1
    for leaf, copy in zip(keep.at_train_end, copies, strict=True):
        np.testing.assert_array_equal(leaf, copy)
    for leaf, copy in zip(jax.tree.leaves(keep.state.params), copies, strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), copy)


@pytest.mark.parametrize("per_example", [False, True], ids=["tensors", "per-example"])
def test_a_loader_the_user_drops_is_not_kept_alive_by_the_trainer(per_example):
    """The pipeline builds its own loader once per user loader (so persistent
    workers persist), but holds it only while the user holds theirs (also
    where it fetches a per-example dataset's batches itself)."""
    import gc
    import weakref

    from tests.helpers import LitMLP, digits, quiet_trainer

    trainer = quiet_trainer(max_epochs=1)
    model = LitMLP()
    loader = _digits_loader(256)
    if per_example:
        loader = DataLoader(_Rows(*digits()), batch_size=256, shuffle=True)
    trainer.fit(model, loader, loader)
    out = trainer.predict(model, loader, concatenate=True)
    assert out["logits"].shape == (len(loader.dataset), 10)
    dropped = weakref.ref(loader)
    del loader
    gc.collect()
    assert dropped() is None
