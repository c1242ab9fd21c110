"""Faults in the data pipeline and the train state that a user meets in a plain fit.

* DataLoader workers must start safely: JAX is multithreaded, so forking it
  (the default start method on Linux) risks a deadlock, and JAX warns about it.
* Persistent workers must persist: started once per fit, not once per epoch.
* A state handed to a callback must stay readable after later steps.

Worker processes started with "forkserver" import this module to unpickle
`record_worker_start`, so it imports only what they need at the top (torch);
JAX, flax and jaxlightning are imported inside the tests.
"""

import functools
import os
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


def record_worker_start(path: str, worker_id: int) -> None:
    """With the path bound by `functools.partial`, a `worker_init_fn` that appends
    one line per worker start. (The path travels with the pickled function: an
    environment variable would not reach the children of a forkserver started
    earlier, which inherit the server's environment.)"""
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {worker_id}\n")


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


def test_workers_start_fork_safe_and_match_single_process_loading(capfd):
    """num_workers=2 and no multiprocessing_context: the Trainer must not fork
    the (multithreaded) JAX process, and the workers must load exactly the
    batches the main process would, in the same order."""
    import jax

    reference = _fit_params(_digits_loader(128), max_epochs=1)
    capfd.readouterr()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = _fit_params(_digits_loader(128, num_workers=2), max_epochs=1)
    err = capfd.readouterr().err

    forked = [str(w.message) for w in caught if "os.fork()" in str(w.message)]
    assert not forked, f"DataLoader workers were forked from the JAX process: {forked[0]}"
    assert "os.fork()" not in err, f"DataLoader workers were forked from the JAX process: {err}"
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
        multiprocessing_context="forkserver",
        worker_init_fn=functools.partial(record_worker_start, str(starts)),
    )
    _fit_params(loader, max_epochs=3)

    lines = starts.read_text().splitlines() if starts.exists() else []
    assert len(lines) == 2, f"expected 2 worker starts over 3 epochs, got {len(lines)}: {lines}"


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


def test_a_loader_the_user_drops_is_not_kept_alive_by_the_trainer():
    """The pipeline builds its own loader once per user loader (so persistent
    workers persist), but holds it only while the user holds theirs."""
    import gc
    import weakref

    from tests.helpers import LitMLP, quiet_trainer

    trainer = quiet_trainer(max_epochs=1)
    model = LitMLP()
    loader = _digits_loader(256)
    trainer.fit(model, loader, loader)
    out = trainer.predict(model, loader)
    assert out["logits"].shape == (len(loader.dataset), 10)
    dropped = weakref.ref(loader)
    del loader
    gc.collect()
    assert dropped() is None
