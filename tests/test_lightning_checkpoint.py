"""`ModelCheckpoint` against Lightning's own tests.

Translated from Lightning's tests/tests_pytorch/checkpointing/test_model_checkpoint.py
(each test names its original), keeping Lightning's expected values. Where
Lightning counts ``*.ckpt`` files, these count step folders: a checkpoint here
is ``{dirpath}/{global_step}``, and Lightning's ``last.ckpt`` is the most recent
of them, not a copy. Several `ModelCheckpoint` callbacks share one fit (each
with its own folder) where Lightning runs one fit per configuration.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from datetime import timedelta
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlightning as jl
from jaxlightning.io.checkpoint import CheckpointWriter, complete_checkpoints, read_meta, restore
from tests.helpers import LitMLP, digits, lightning_trainer, loader, max_abs_diff

BATCH = 8


class Logged(LitMLP):
    """A small `LitMLP` that logs given values, as Lightning's test models do.

    In ``loss``: ``train_log`` (``train_table[global_step]``, per step and per
    epoch), ``foo`` (``(epoch + 1) / 10``) and ``nan``; the last two are named
    ``foo`` and ``nan`` (Lightning's names, as logged). After each validation
    (not the sanity check's): the next value of each list in ``val_values``.
    """

    def __init__(self, train_table=None, val_values=None):
        super().__init__(hidden=4)
        self.train_table = None if train_table is None else jnp.asarray(train_table)
        self.val_values = val_values or {}
        self.validations = 0

    def loss(self, variables, batch, rngs):
        if self.train_table is not None:
            self.log("train_log", self.train_table[self.global_step], on_epoch=True)
        self.log("foo", (self.current_epoch + 1) / 10)
        self.log("nan", jnp.nan)
        return super().loss(variables, batch, rngs)

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        for name, values in self.val_values.items():
            self.log(name, values[self.validations])
        self.validations += 1


def data(batches: int):
    x, y = digits(batches * BATCH)
    return loader(x, y, BATCH)


@contextlib.contextmanager
def recording_writes():
    """Records ``(folder name, step)`` of every checkpoint written (Lightning
    patches ``trainer.save_checkpoint`` to count them)."""
    writes: list[tuple[str, int]] = []
    original = CheckpointWriter.save

    def save(self, step, tree, meta):
        writes.append((os.path.basename(self.dirpath), step))
        return original(self, step, tree, meta)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointWriter, "save", save)
        yield writes


def steps(folder) -> list[int]:
    """The steps of the complete checkpoints in ``folder``."""
    return [int(Path(p).name) for p in complete_checkpoints(folder)]


def position(path) -> tuple[int, int, int]:
    """``(epoch, batch, global_step)`` a checkpoint resumes at."""
    progress = read_meta(path)["progress"]
    return progress["epoch"], progress["batch"], progress["global_step"]


def written(writes, name: str) -> list[int]:
    return [step for folder, step in writes if folder == name]


def own_state(path, ckpt: jl.ModelCheckpoint) -> dict:
    """``ckpt``'s state as recorded in the checkpoint at ``path``."""
    states = read_meta(path)["callbacks"].values()
    return next(s for s in states if s.get("dirpath") == os.path.abspath(ckpt.dirpath))


def fit_with(root, callbacks, module, train, val=None, **trainer_kwargs):
    """One fit with these ``callbacks``; returns the Trainer and what it printed."""
    trainer = lightning_trainer(default_root_dir=root, callbacks=callbacks, **trainer_kwargs)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(module, train, val)
    return trainer, out.getvalue()


# ----------------------------------------------------------- arguments
# Lightning: test_invalid_top_k
def test_invalid_top_k(tmp_path):
    with pytest.raises(ValueError, match=r".*Must be >= -1"):
        jl.ModelCheckpoint(dirpath=tmp_path, save_top_k=-3)


# Lightning: test_none_monitor_top_k
def test_none_monitor_top_k(tmp_path):
    with pytest.raises(
        ValueError, match=r"ModelCheckpoint\(save_top_k=3, monitor=None\) is not a valid*"
    ):
        jl.ModelCheckpoint(dirpath=tmp_path, save_top_k=3)
    for k in (-1, 0, 1):  # these should not fail
        jl.ModelCheckpoint(dirpath=tmp_path, save_top_k=k)


# Lightning: test_invalid_every_n_epochs
def test_invalid_every_n_epochs(tmp_path):
    with pytest.raises(ValueError, match=r".*Must be >= 0"):
        jl.ModelCheckpoint(dirpath=tmp_path, every_n_epochs=-3)
    for n in (0, 1, 2):  # these should not fail
        jl.ModelCheckpoint(dirpath=tmp_path, every_n_epochs=n)


# Lightning: test_invalid_every_n_train_steps
def test_invalid_every_n_train_steps(tmp_path):
    with pytest.raises(ValueError, match=r".*Must be >= 0"):
        jl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=-3)
    jl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=0)
    jl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)
    jl.ModelCheckpoint(dirpath=tmp_path, every_n_epochs=2)


# Lightning: test_invalid_trigger_combination
def test_invalid_trigger_combination(tmp_path):
    match = r".*Combination of parameters every_n_train_steps"
    with pytest.raises(ValueError, match=match):
        jl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, every_n_epochs=2)
    with pytest.raises(ValueError, match=match):
        jl.ModelCheckpoint(train_time_interval=timedelta(minutes=1), every_n_epochs=2)
    with pytest.raises(ValueError, match=match):
        jl.ModelCheckpoint(train_time_interval=timedelta(minutes=1), every_n_train_steps=2)
    # These should not fail
    jl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=0, every_n_epochs=3)
    jl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, every_n_epochs=0)
    jl.ModelCheckpoint(
        dirpath=tmp_path,
        every_n_train_steps=0,
        every_n_epochs=0,
        train_time_interval=timedelta(minutes=1),
    )


# Lightning: test_none_every_n_train_steps_val_epochs
def test_none_every_n_train_steps_val_epochs(tmp_path):
    checkpoint_callback = jl.ModelCheckpoint(dirpath=tmp_path)
    assert checkpoint_callback.every_n_epochs == 1
    assert checkpoint_callback.every_n_train_steps == 0


# Lightning: test_model_checkpoint_mode_options
def test_model_checkpoint_mode_options():
    with pytest.raises(ValueError, match="`mode` can be .* but got unknown_option"):
        jl.ModelCheckpoint(mode="unknown_option")


# Lightning: test_configure_model_checkpoint (except `trainer.checkpoint_callbacks`,
# which the Trainer does not have)
def test_configure_model_checkpoint(tmp_path):
    kwargs = {"default_root_dir": tmp_path, "enable_progress_bar": False}
    callback1 = jl.ModelCheckpoint(monitor="foo")
    callback2 = jl.ModelCheckpoint(monitor="bar")

    trainer = jl.Trainer(enable_checkpointing=False, callbacks=[], **kwargs)
    assert not any(isinstance(c, jl.ModelCheckpoint) for c in trainer.callbacks)
    assert trainer.checkpoint_callback is None

    trainer = jl.Trainer(callbacks=[], **kwargs)
    assert sum(1 for c in trainer.callbacks if isinstance(c, jl.ModelCheckpoint)) == 1
    assert isinstance(trainer.checkpoint_callback, jl.ModelCheckpoint)

    trainer = jl.Trainer(enable_checkpointing=True, callbacks=[callback1], **kwargs)
    assert [c for c in trainer.callbacks if isinstance(c, jl.ModelCheckpoint)] == [callback1]
    assert trainer.checkpoint_callback == callback1

    trainer = jl.Trainer(callbacks=[callback1, callback2], **kwargs)
    assert trainer.checkpoint_callback == callback1

    with pytest.raises(
        ValueError, match="`enable_checkpointing=False` but found `ModelCheckpoint`"
    ):
        jl.Trainer(enable_checkpointing=False, callbacks=[callback1], **kwargs)


# ------------------------------------------------- 3 epochs of 5 steps, no validation
@pytest.fixture(scope="module")
def no_val(tmp_path_factory):
    """One fit of 3 epochs of 5 steps without validation, checkpointed by a
    `ModelCheckpoint` per Lightning test (each in its own folder)."""
    root = tmp_path_factory.mktemp("no_val")
    table = np.random.default_rng(0).normal(size=15).astype(np.float32)
    ckpts = {
        "train_log": jl.ModelCheckpoint(
            root / "train_log", monitor="train_log_epoch", save_top_k=-1
        ),
        "foo": jl.ModelCheckpoint(root / "foo", save_top_k=3, monitor="foo", mode="min"),
        "nan_min": jl.ModelCheckpoint(root / "nan_min", save_top_k=1, monitor="nan", mode="min"),
        "nan_max": jl.ModelCheckpoint(root / "nan_max", save_top_k=1, monitor="nan", mode="max"),
        "epoch": jl.ModelCheckpoint(root / "epoch", monitor="epoch", mode="max", save_top_k=-1),
        "step": jl.ModelCheckpoint(root / "step", monitor="step", mode="max", save_top_k=2),
        "all": jl.ModelCheckpoint(root / "all", monitor=None, save_top_k=-1, save_last=True),
        "default": jl.ModelCheckpoint(root / "default"),
        "weights": jl.ModelCheckpoint(root / "weights", save_weights_only=True),
        "verbose": jl.ModelCheckpoint(root / "verbose", monitor="foo", mode="max", verbose=True),
    }
    with recording_writes() as writes:
        trainer, out = fit_with(root, list(ckpts.values()), Logged(table), data(5), max_epochs=3)
    return {"ckpts": ckpts, "writes": writes, "table": table, "trainer": trainer, "out": out}


# Lightning: test_model_checkpoint_score_and_ckpt (validation_step_none=True:
# monitor="train_log_epoch", checked at each training epoch's end)
def test_model_checkpoint_score_and_ckpt_without_validation(no_val):
    ckpt, table = no_val["ckpts"]["train_log"], no_val["table"]
    max_epochs, limit_train_batches = 3, 5
    assert len(steps(ckpt.dirpath)) == max_epochs
    for epoch in range(max_epochs):
        expected_score = table[epoch * 5 : (epoch + 1) * 5].mean()
        global_step = limit_train_batches * (epoch + 1)
        path = Path(ckpt.dirpath) / str(global_step)
        state = own_state(path, ckpt)
        assert math.isclose(state["current_score"], expected_score, abs_tol=1e-5)
        assert state["monitor"] == "train_log_epoch"
        assert state["dirpath"] == os.path.abspath(ckpt.dirpath)
        assert state["records"][-1]["epoch"] == epoch
        assert position(path)[2] == global_step


# Lightning: test_current_score
def test_current_score(no_val):
    ckpt = no_val["ckpts"]["foo"]
    assert ckpt.current_score == pytest.approx(0.3)
    scores = [own_state(p, ckpt)["current_score"] for p in complete_checkpoints(ckpt.dirpath)]
    assert sorted(scores) == pytest.approx([0.1, 0.2, 0.3])


# Lightning: test_current_score_when_nan (3 epochs of NaN instead of 1: the
# first one stays the best, as ``inf`` is not better than ``inf``)
@pytest.mark.parametrize("mode", ["min", "max"])
def test_current_score_when_nan(no_val, mode):
    ckpt = no_val["ckpts"][f"nan_{mode}"]
    expected = float("inf" if mode == "min" else "-inf")
    assert ckpt.best_model_score == expected
    assert ckpt.current_score == expected
    assert written(no_val["writes"], f"nan_{mode}") == [5]


# Lightning: test_model_checkpoint_topk_all (monitor="epoch")
def test_model_checkpoint_topk_all(no_val):
    ckpt, epochs, folder = no_val["ckpts"]["epoch"], 3, Path(no_val["ckpts"]["epoch"].dirpath)
    assert ckpt.monitor == "epoch"
    assert ckpt.best_model_path == str(folder / "15")  # epoch=2
    assert ckpt.best_model_score == epochs - 1
    assert len(steps(folder)) == len(ckpt.best_k_models) == epochs
    assert set(ckpt.best_k_models) == {str(folder / str(5 * (i + 1))) for i in range(epochs)}
    assert ckpt.kth_best_model_path == str(folder / "5")  # epoch=0


def test_monitor_step_ranks_by_global_step(no_val):
    # Lightning's `_monitor_candidates`: "step" is the global step unless logged
    ckpt = no_val["ckpts"]["step"]
    assert steps(ckpt.dirpath) == [10, 15]
    assert ckpt.best_model_path.endswith("/15") and ckpt.best_model_score == 15
    assert ckpt.kth_best_model_path.endswith("/10")


# Lightning: test_model_checkpoint_save_last_none_monitor (3 epochs of 5 steps)
def test_model_checkpoint_save_last_none_monitor(no_val):
    ckpt = no_val["ckpts"]["all"]
    assert ckpt.monitor is None
    assert ckpt.best_model_path == os.path.join(ckpt.dirpath, "15")  # the most recent
    assert ckpt.last_model_path == os.path.join(ckpt.dirpath, "15")
    assert ckpt.best_model_score is None
    assert ckpt.best_k_models == {}
    assert ckpt.kth_best_model_path == ""
    assert steps(ckpt.dirpath) == [5, 10, 15]


# Lightning: test_default_checkpoint_behavior
def test_default_checkpoint_behavior(no_val):
    ckpt = no_val["ckpts"]["default"]
    assert written(no_val["writes"], "default") == [5, 10, 15]
    assert steps(ckpt.dirpath) == [15]
    assert position(ckpt.best_model_path) == (3, 0, 15)


def test_save_weights_only_writes_the_weights_and_refuses_to_resume(no_val, tmp_path):
    # Lightning: `save_weights_only=True` leaves the optimizer states out; resuming
    # from such a checkpoint is refused ("contains only the model").
    path = no_val["ckpts"]["weights"].last_model_path
    full = no_val["ckpts"]["default"].last_model_path
    assert path.endswith("/15") and full.endswith("/15")
    state = restore(path)["state"]
    assert "params" in state and "opt_state" not in state
    assert "opt_state" in restore(full)["state"]
    assert read_meta(path)["weights_only"] is True
    loaded = LitMLP.load_from_checkpoint(path)
    assert max_abs_diff(loaded.variables["params"], restore(full)["state"]["params"]) == 0.0

    trainer = lightning_trainer(max_epochs=4, default_root_dir=tmp_path)
    with pytest.raises(jl.CheckpointError, match=r"holds the model's weights only"):
        trainer.fit(Logged(), data(5), ckpt_path=path)


def test_verbose_prints_each_check_of_the_monitored_value(no_val):
    # Lightning's messages (`rank_zero_info`), printed on process 0
    folder = no_val["ckpts"]["verbose"].dirpath
    lines = [line for line in no_val["out"].splitlines() if "'foo'" in line]
    assert lines == [
        f"Epoch {e}, global step {5 * (e + 1)}: 'foo' reached {(e + 1) / 10:0.5f} (best "
        f"{(e + 1) / 10:0.5f}), saving model to '{folder}/{5 * (e + 1)}' as top 1"
        for e in range(3)
    ]


# ------------------------------------------------- 5 epochs of 4 steps, triggers
@pytest.fixture(scope="module")
def triggers(tmp_path_factory):
    """One fit of 5 epochs of 4 steps, no validation, with a `ModelCheckpoint`
    per trigger configuration. Where Lightning's test keeps its default
    ``save_last=None``, ``save_last=False`` is passed (the default here is True)."""
    root = tmp_path_factory.mktemp("triggers")
    ckpts = [
        jl.ModelCheckpoint(root / f"every_{n}", save_top_k=-1, every_n_epochs=n, save_last=False)
        for n in range(4)
    ]
    ckpts += [
        jl.ModelCheckpoint(
            root / "steps", every_n_epochs=0, every_n_train_steps=3, save_top_k=-1, save_last=False
        ),
        jl.ModelCheckpoint(root / "topk_zero", save_top_k=0, save_last=True),
    ]
    ckpts += [
        jl.ModelCheckpoint(
            root / f"last_every_{n}",
            every_n_epochs=n,
            save_last=True,
            save_top_k=0,
            save_on_train_epoch_end=True,
        )
        for n in (0, 5)
    ]
    with recording_writes() as writes:
        fit_with(root, ckpts, Logged(), data(4), max_epochs=5)
    return root, writes, ckpts


# Lightning: test_model_checkpoint_every_n_epochs
@pytest.mark.parametrize("every_n_epochs", list(range(4)))
def test_model_checkpoint_every_n_epochs(triggers, every_n_epochs):
    root, _, _ = triggers
    epochs, per_epoch = 5, 4
    expected = (
        [e for e in range(epochs) if not (e + 1) % every_n_epochs] if every_n_epochs > 0 else []
    )
    kept = steps(root / f"every_{every_n_epochs}")
    assert kept == [per_epoch * (e + 1) for e in expected]
    for step, epoch in zip(kept, expected, strict=True):
        assert position(root / f"every_{every_n_epochs}" / str(step)) == (epoch + 1, 0, step)


# Lightning: test_ckpt_every_n_train_steps (every 3 of 20 steps instead of 16 of 128)
def test_ckpt_every_n_train_steps(triggers):
    root, writes, _ = triggers
    every_n_train_steps, total = 3, 5 * 4
    expected = list(range(every_n_train_steps, total + 1, every_n_train_steps))
    assert steps(root / "steps") == expected
    assert written(writes, "steps") == expected


# Lightning: test_model_checkpoint_topk_zero
def test_model_checkpoint_topk_zero(triggers):
    root, writes, ckpts = triggers
    ckpt = ckpts[5]
    assert ckpt.monitor is None
    assert ckpt.best_model_path == ""
    assert ckpt.best_model_score is None
    assert ckpt.best_k_models == {}
    assert ckpt.kth_best_model_path == ""
    # only the last checkpoint was created, at the end of the fit
    assert steps(root / "topk_zero") == [20] and written(writes, "topk_zero") == [20]
    assert ckpt.last_model_path == str(root / "topk_zero" / "20")


# Lightning: test_save_last_every_n_epochs_interaction (5 epochs: every_n_epochs=5
# falls on the last one, 0 on none; one save either way, as Lightning's count)
@pytest.mark.parametrize("every_n_epochs", [0, 5])
def test_save_last_every_n_epochs_interaction(triggers, every_n_epochs):
    root, writes, ckpts = triggers
    ckpt = ckpts[6 if every_n_epochs == 0 else 7]
    assert ckpt.last_model_path  # a "last" ckpt was saved
    assert len(written(writes, f"last_every_{every_n_epochs}")) == 1


# ---------------------------------------- 4 epochs of 2 steps, validation at each end
@pytest.fixture(scope="module")
def with_val(tmp_path_factory):
    root = tmp_path_factory.mktemp("with_val")
    val_logs = list(np.random.default_rng(1).normal(size=4))
    values = {
        "val_log": val_logs,
        "abc_min": [float("nan"), 8, 7, 5],
        "abc_max": [float("nan"), 5, 7, 8],
        "val_loss": [1.0 - e * 0.1 if e % 2 == 0 else 1.0 + e * 0.1 for e in range(4)],
    }
    ckpts = {
        "val_log": jl.ModelCheckpoint(root / "val_log", monitor="val_log", save_top_k=-1),
        "abc_min": jl.ModelCheckpoint(
            root / "abc_min", monitor="abc_min", mode="min", verbose=True
        ),
        "abc_max": jl.ModelCheckpoint(root / "abc_max", monitor="abc_max", mode="max"),
        "val_loss": jl.ModelCheckpoint(
            root / "val_loss",
            monitor="val_loss",
            save_last=True,
            save_top_k=1,
            mode="min",
            every_n_epochs=1,
            save_on_train_epoch_end=False,
        ),
    }
    with recording_writes() as writes:
        _, out = fit_with(
            root, list(ckpts.values()), Logged(val_values=values), data(2), data(1), max_epochs=4
        )
    return {"ckpts": ckpts, "writes": writes, "values": values, "out": out}


# Lightning: test_model_checkpoint_score_and_ckpt (monitor="val_log", checked at
# each training epoch's end, after that epoch's validation)
def test_model_checkpoint_score_and_ckpt(with_val):
    ckpt, val_logs, max_epochs = with_val["ckpts"]["val_log"], with_val["values"]["val_log"], 4
    assert len(steps(ckpt.dirpath)) == max_epochs
    for epoch in range(max_epochs):
        path = Path(ckpt.dirpath) / str(2 * (epoch + 1))
        state = own_state(path, ckpt)
        assert math.isclose(state["current_score"], val_logs[epoch], abs_tol=1e-5)
        assert state["records"][-1]["epoch"] == epoch
        assert position(path) == (epoch + 1, 0, 2 * (epoch + 1))


# Lightning: test_checkpointing_with_nan_as_first
@pytest.mark.parametrize("mode", ["min", "max"])
def test_checkpointing_with_nan_as_first(with_val, mode):
    ckpt = with_val["ckpts"][f"abc_{mode}"]
    monitor = with_val["values"][f"abc_{mode}"]
    # every check improved on the one before: each was saved, the last is the best
    assert len(written(with_val["writes"], f"abc_{mode}")) == len(monitor)
    assert (mode == "min" and ckpt.best_model_score == 5) or (
        mode == "max" and ckpt.best_model_score == 8
    )
    assert steps(ckpt.dirpath) == [8]


def test_verbose_names_the_nan_first_check_inf(with_val):
    folder = with_val["ckpts"]["abc_min"].dirpath
    lines = [line for line in with_val["out"].splitlines() if "'abc_min'" in line]
    assert lines[0] == (
        f"Epoch 0, global step 2: 'abc_min' reached inf (best inf), saving model to "
        f"'{folder}/2' as top 1"
    )
    assert lines[-1].startswith("Epoch 3, global step 8: 'abc_min' reached 5.00000 (best 5.00000)")


# Lightning: test_save_last_only_when_checkpoint_saved. Lightning keeps two files,
# the best and last.ckpt, both of epoch 2; here they are one folder.
def test_save_last_only_when_checkpoint_saved(with_val):
    ckpt = with_val["ckpts"]["val_loss"]
    assert written(with_val["writes"], "val_loss") == [2, 6]  # epochs 0 and 2 improved
    assert steps(ckpt.dirpath) == [6]
    assert ckpt.last_model_path == ckpt.best_model_path == os.path.join(ckpt.dirpath, "6")
    assert ckpt.best_model_score == pytest.approx(0.8)


# ------------------------------------------- validation several times an epoch
@pytest.fixture(scope="module", params=[0.25, 0.42])
def val_interval(request, tmp_path_factory):
    """3 epochs of 12 steps validating every ``val_check_interval`` of an epoch."""
    val_check_interval = request.param
    root = tmp_path_factory.mktemp("val_interval")
    per_val = int(12 * val_check_interval)
    checks = 12 // per_val
    val_logs = list(np.random.default_rng(2).normal(size=checks * 3))
    ckpts = [
        jl.ModelCheckpoint(root / "val_log", monitor="val_log", save_top_k=-1),
        jl.ModelCheckpoint(
            root / "epoch_end", monitor="val_log", save_top_k=-1, save_on_train_epoch_end=True
        ),
    ]
    fit_with(
        root,
        ckpts,
        Logged(val_values={"val_log": val_logs}),
        data(12),
        data(1),
        max_epochs=3,
        val_check_interval=val_check_interval,
        num_sanity_val_steps=0,
    )
    return val_check_interval, ckpts, val_logs


# Lightning: test_model_checkpoint_score_and_ckpt_val_check_interval
# (reduce_lr_on_plateau has no counterpart: schedules are optax transformations)
def test_model_checkpoint_score_and_ckpt_val_check_interval(val_interval):
    val_check_interval, (ckpt, _), val_logs = val_interval
    max_epochs, limit_train_batches = 3, 12
    per_val_train_batches = int(limit_train_batches * val_check_interval)
    per_epoch_val_checks, leftover_train_batches = divmod(
        limit_train_batches, per_val_train_batches
    )
    assert len(steps(ckpt.dirpath)) == per_epoch_val_checks * max_epochs

    for epoch in range(max_epochs):
        for ix in range(per_epoch_val_checks):
            global_ix = ix + per_epoch_val_checks * epoch
            expected_global_step = per_val_train_batches * (global_ix + 1) + (
                leftover_train_batches * epoch
            )
            path = Path(ckpt.dirpath) / str(expected_global_step)
            state = own_state(path, ckpt)
            assert math.isclose(state["current_score"], val_logs[global_ix], rel_tol=1e-4)
            assert state["records"][-1]["epoch"] == epoch
            # The resume position: after the validation's batch, or, for the one at
            # an epoch's end (saved at that end), the next epoch's start.
            batch = per_val_train_batches * (ix + 1)
            resume_at = (epoch, batch) if batch < limit_train_batches else (epoch + 1, 0)
            assert position(path) == (*resume_at, expected_global_step)


def test_save_on_train_epoch_end_checks_only_at_epoch_ends(val_interval):
    _, (_, ckpt), val_logs = val_interval
    assert steps(ckpt.dirpath) == [12, 24, 36]
    checks = len(val_logs) // 3
    for epoch, step in enumerate([12, 24, 36]):
        # the value of the epoch's last validation, the latest at its end
        state = own_state(Path(ckpt.dirpath) / str(step), ckpt)
        assert state["current_score"] == pytest.approx(val_logs[checks * (epoch + 1) - 1])


# Lightning: test_check_val_every_n_epochs_top_k_integration
def test_check_val_every_n_epochs_top_k_integration(tmp_path):
    mc = jl.ModelCheckpoint(tmp_path / "ckpt", monitor="epoch", save_top_k=-1, save_last=False)
    fit_with(
        tmp_path,
        [mc],
        Logged(),
        data(1),
        data(1),
        num_sanity_val_steps=0,
        max_epochs=5,
        check_val_every_n_epoch=2,
    )
    epochs = [
        own_state(Path(mc.dirpath) / str(s), mc)["records"][-1]["epoch"] for s in steps(mc.dirpath)
    ]
    assert epochs == [1, 3]


# Lightning: test_model_checkpoint_train_time_interval (the clock mocked: 7 s per batch)
def test_model_checkpoint_train_time_interval(tmp_path, monkeypatch):
    seconds_per_batch = 7
    batches_per_epoch, num_epochs = 64, 2
    calls = batches_per_epoch * num_epochs + 1  # on_train_start, then after each batch
    ticks = iter([1000.0 + seconds_per_batch * i for i in range(calls)])

    class Clock:
        @staticmethod
        def monotonic():
            return next(ticks)

    monkeypatch.setattr("jaxlightning.callbacks.checkpoint.time", Clock)
    ckpt = jl.ModelCheckpoint(
        tmp_path, train_time_interval=timedelta(minutes=1), save_top_k=-1, save_last=False
    )
    fit_with(tmp_path, [ckpt], Logged(), data(batches_per_epoch), max_epochs=num_epochs)
    # Each batch takes 7 sec and we checkpoint every minute: 896 sec in all, so
    # we should have 14 checkpoints.
    assert len(steps(tmp_path)) == 14


# Lightning: test_model_checkpoint_path
@pytest.mark.parametrize(
    ("logger_version", "expected"), [(None, "version_0"), (1, "version_1"), ("awesome", "awesome")]
)
def test_model_checkpoint_path(tmp_path, logger_version, expected):
    logger = jl.TensorBoardLogger(tmp_path, version=logger_version)
    trainer = lightning_trainer(
        default_root_dir=tmp_path, max_epochs=2, logger=logger, enable_checkpointing=True
    )
    trainer.fit(Logged(), data(1))
    ckpt_version = Path(trainer.checkpoint_callback.dirpath).parent.name
    assert ckpt_version == expected
    assert steps(tmp_path / "lightning_logs" / expected / "checkpoints") == [2]


# Lightning: trainer.save_checkpoint(filepath) after fit, then ckpt_path=filepath
# and load_from_checkpoint(filepath) (its checkpointing/test_trainer_checkpoint.py,
# and the docs' "trainer.save_checkpoint('example.ckpt')").
def test_save_checkpoint_writes_a_checkpoint_that_resumes_and_loads(tmp_path):
    import jax

    x, y = digits(48)

    def fit(max_epochs, ckpt_path=None):
        trainer = lightning_trainer(max_epochs=max_epochs, enable_checkpointing=False)
        module = LitMLP(hidden=8)
        trainer.fit(module, loader(x, y, 16), ckpt_path=ckpt_path)
        return trainer, module

    with pytest.raises(RuntimeError, match="call trainer.fit"):
        lightning_trainer().save_checkpoint(tmp_path / "none")
    first, module = fit(1)
    path = first.save_checkpoint(tmp_path / "example.ckpt")
    assert (
        path == str(tmp_path / "example.ckpt") and read_meta(path)["progress"]["global_step"] == 3
    )
    assert [p.name for p in tmp_path.iterdir()] == ["example.ckpt"]  # no staging left
    loaded = LitMLP.load_from_checkpoint(path)
    same = jax.tree.map(np.array_equal, loaded.variables, module.variables)
    assert all(jax.tree.leaves(same))
    resumed, _ = fit(2, ckpt_path=path)
    straight, _ = fit(2)
    assert max_abs_diff(resumed.state.params, straight.state.params) == 0.0
    light = first.save_checkpoint(tmp_path / "example.ckpt", weights_only=True)  # replaced
    assert read_meta(light)["weights_only"] is True


class LegacyKeyed(jl.Callback):
    """A callback whose ``state_key`` is its type (Lightning's legacy key)."""

    @property
    def state_key(self):
        return type(self)

    def state_dict(self):
        return {"seen": 1}


def test_a_callback_keyed_by_its_type_is_saved_under_its_name(tmp_path):
    # Lightning accepts a type as state_key; the JSON record keeps its name
    trainer = lightning_trainer(max_epochs=1, callbacks=[LegacyKeyed()])
    trainer.fit(LitMLP(hidden=8), loader(*digits(32), 16))
    meta = read_meta(trainer.save_checkpoint(tmp_path / "c"))
    assert meta["callbacks"]["LegacyKeyed"] == {"seen": 1}


def test_two_checkpoints_in_the_default_dirpath_share_its_step_folders(tmp_path):
    # Two ModelCheckpoints with the default dirpath (Lightning writes both
    # callbacks' files into one folder): both save each epoch's step, one keeps
    # the lowest foo (the first), the other the highest (the newest). The step
    # is written once, and neither deletes a folder the other still keeps.
    lowest = jl.ModelCheckpoint(monitor="foo", mode="min", save_top_k=1)
    highest = jl.ModelCheckpoint(monitor="foo", mode="max", save_top_k=1)
    trainer = lightning_trainer(
        max_epochs=3, default_root_dir=tmp_path, callbacks=[lowest, highest]
    )
    with recording_writes() as writes:
        trainer.fit(Logged(), data(2))
    assert lowest.dirpath == highest.dirpath == os.path.join(tmp_path, "checkpoints")
    assert written(writes, "checkpoints") == [2, 4, 6]  # once each, not twice
    assert lowest.best_model_path == os.path.join(lowest.dirpath, "2")  # foo 0.1, 0.2, 0.3
    assert highest.best_model_path == os.path.join(lowest.dirpath, "6")
    assert steps(lowest.dirpath) == [2, 6]  # 4 was kept by neither


def test_two_checkpoints_in_one_dirpath_that_save_different_contents_are_refused(tmp_path):
    full = jl.ModelCheckpoint(dirpath=tmp_path)
    weights = jl.ModelCheckpoint(dirpath=tmp_path, save_weights_only=True)
    trainer = lightning_trainer(max_epochs=1, callbacks=[full, weights])
    with pytest.raises(ValueError, match="save_weights_only=True.*dirpath of its own"):
        trainer.fit(Logged(), data(2))


def test_the_checkpoint_resumed_from_is_never_deleted(tmp_path):
    # Lightning's ModelCheckpoint._should_remove_checkpoint: "the previous
    # checkpoint is the checkpoint the Trainer resumed from" is kept (its
    # test_model_checkpoint.py resume tests with save_top_k=2 into the same dirpath).
    def fit(values, max_epochs, ckpt_path=None):
        ckpt = jl.ModelCheckpoint(tmp_path, monitor="val_log", save_top_k=2)
        trainer = lightning_trainer(callbacks=[ckpt], num_sanity_val_steps=0, max_epochs=max_epochs)
        module = Logged(val_values={"val_log": values})
        trainer.fit(module, data(2), data(1), ckpt_path=ckpt_path)
        return trainer, ckpt

    fit([5.0, 4.0], max_epochs=2)  # keeps steps 2 and 4
    assert steps(tmp_path) == [2, 4]
    with pytest.warns(UserWarning, match="Moved them to"):  # step 4: another future
        trainer, ckpt = fit([3.0, 2.0], max_epochs=3, ckpt_path=str(tmp_path / "2"))
    assert trainer.ckpt_path == str(tmp_path / "2")
    assert set(ckpt.best_k_models) == {str(tmp_path / "4"), str(tmp_path / "6")}
    assert steps(tmp_path) == [2, 4, 6]  # 2 left the top 2 but is where it resumed from


def test_a_monitor_nobody_logs_fails_once_a_validation_ran(tmp_path):
    # ModelCheckpoint._validate_monitor_key: MisconfigurationException once the
    # validation loop has run (here ValueError), a warning before that
    checkpoint = jl.ModelCheckpoint(tmp_path / "a", monitor="nobody_logs_this")
    trainer = lightning_trainer(max_epochs=1, callbacks=[checkpoint])
    with pytest.raises(ValueError, match=r"could not find the monitored key.*HINT"):
        trainer.fit(Logged(), data(2), data(1))
    checkpoint = jl.ModelCheckpoint(tmp_path / "b", monitor="nobody_logs_this")
    trainer = lightning_trainer(max_epochs=1, callbacks=[checkpoint])
    with pytest.warns(UserWarning, match="could not find the monitored key"):
        trainer.fit(Logged(), data(2))  # no validation: a warning
