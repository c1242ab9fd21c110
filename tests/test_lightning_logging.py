"""`self.log` and traced counters as Lightning's own tests expect them.

The cases are translations of Lightning's tests (named in each test's comment,
from tests/tests_pytorch/), with Lightning's expected values. Where the
Lightning test runs on several DDP ranks, the single-device expectations are
kept: our devices are the Trainer's business, not the user's.
"""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlightning as jl
from tests.helpers import (
    LitMLP,
    digits,
    init_mlp,
    lightning_trainer,
    loader,
    np_cross_entropy,
    np_logits,
    quiet_trainer,
)

X, Y = digits(64)
VX, VY = digits(24, 500)


class Logs(LitMLP):
    """`LitMLP` that logs what a test asks for in the hooks a test names."""

    def __init__(self, train=None, val=None, host=None, **kwargs):
        super().__init__(**kwargs)
        self.train_logs = train or (lambda module: None)
        self.val_logs = val or (lambda module: None)
        self.host = host or {}

    def loss(self, variables, batch, rngs):
        self.train_logs(self)
        return super().loss(variables, batch, rngs)

    def eval_step(self, variables, batch):
        super().eval_step(variables, batch)
        self.val_logs(self)

    def __getattribute__(self, name):
        host = object.__getattribute__(self, "__dict__").get("host", {})
        if name in host:
            return lambda *args: host[name](self)
        return object.__getattribute__(self, name)


def _csv_rows(logger):
    with open(logger.metrics_file_path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------ traced counters
def test_current_epoch_is_traced_in_loss_and_validation(compiles):
    """A port that scales by ``self.current_epoch`` inside the step logs the right
    value in every epoch (it was a Python int frozen at the first trace)."""

    def train(m):
        m.log("epoch_seen", m.current_epoch * 1.0, on_step=False, on_epoch=True)
        m.log("epoch_scaled", (m.current_epoch + 1) * 2.0, on_step=False, on_epoch=True)

    def val(m):
        m.log("epoch_seen", m.current_epoch.astype(jnp.float32))

    history = []

    def remember(m):
        history.append({k: float(v) for k, v in m.trainer.callback_metrics.items()})

    module = Logs(train=train, val=val, host={"on_validation_epoch_end": remember})
    # the same name in training and validation: kept apart by the stage prefix
    trainer = quiet_trainer(max_epochs=3, num_sanity_val_steps=0, stage_prefix=True)
    trainer.fit(module, loader(X, Y, 16), loader(VX, VY, 8))
    assert [h["train/epoch_seen"] for h in history] == [0.0, 1.0, 2.0]
    assert [h["train/epoch_scaled"] for h in history] == [2.0, 4.0, 6.0]
    assert [h["val/epoch_seen"] for h in history] == [0.0, 1.0, 2.0]
    assert compiles.matching("jl_train_step") == 1  # no recompile per epoch


@pytest.mark.parametrize("use", ["branch", "float"])
def test_python_branch_on_current_epoch_says_to_use_jnp_where(use):
    class Branches(LitMLP):
        def loss(self, variables, batch, rngs):
            per_example = super().loss(variables, batch, rngs)
            if use == "float":  # a Python number from a traced value
                return per_example * (1.0 + float(self.current_epoch))
            if self.current_epoch > 0:  # a Python branch on a traced value
                return per_example * 2
            return per_example

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        quiet_trainer(max_epochs=1).fit(Branches(), loader(X, Y, 16))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "self.current_epoch" in notes and "jnp.where" in notes


# ------------------------------------------------------------- value checks
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "`NoneType` values cannot be logged"),
        ("text", "`str` values cannot be logged"),
        ([1.0, 2.0], "`list` values cannot be logged"),
        ({"a": {"b": 1.0}}, "nested dictionaries cannot be logged"),
    ],
)
def test_invalid_values_raise_value_error(value, message):
    # core/test_lightning_module.py::test_fabric_log / test_fabric_log_dict
    module = Logs(val=lambda m: m.log("bad", value))
    with pytest.raises(ValueError, match=message):
        quiet_trainer().validate(module, loader(VX, VY, 8))


def test_dataloader_idx_in_a_name_is_refused_in_training():
    # trainer/logging_/test_train_loop_logging.py::test_logging_raises
    module = Logs(train=lambda m: m.log("foo/dataloader_idx_0", -1.0))
    with pytest.raises(ValueError, match="'foo/dataloader_idx_0'.*should not carry"):
        quiet_trainer(max_steps=1).fit(module, loader(X, Y, 16))


def test_log_outside_a_trainer_warns_and_records_nothing():
    # core/module.py: "the `self.trainer` reference is not registered on the model yet"
    module = LitMLP()
    with pytest.warns(UserWarning, match="not attached to a Trainer"):
        module.log("acc", 1.0)


def test_logger_true_without_a_logger_warns():
    # trainer/logging_: "You called `self.log(...)` but have no logger configured"
    module = Logs(val=lambda m: m.log("seen", 1.0, logger=True))
    with pytest.warns(UserWarning, match="logger=True.*no logger"):
        quiet_trainer(logger=False).validate(module, loader(VX, VY, 8))


@pytest.mark.parametrize(
    "hook",
    ["on_fit_start", "on_train_end", "on_validation_end", "on_fit_end"],
)
def test_log_is_refused_where_lightning_refuses_it(hook):
    # trainer/logging_/test_logger_connector.py::test_fx_validator_integration
    module = Logs(host={hook: lambda m: m.log("foo", 1.0)})
    with pytest.raises(RuntimeError, match=rf"in {hook}\(\).*does not allow logging"):
        quiet_trainer(max_steps=1, limit_val_batches=1).fit(
            module, loader(X, Y, 16), loader(VX, VY, 8)
        )


def test_log_in_setup_and_predict_is_refused():
    class LogsInSetup(LitMLP):
        def setup(self, rng, batch):
            self.log("foo", 1.0)
            return super().setup(rng, batch)

    with pytest.raises(RuntimeError, match=r"in setup\(\).*does not allow logging"):
        quiet_trainer(max_steps=1).fit(LogsInSetup(), loader(X, Y, 16))

    class LogsInPredict(LitMLP):
        def predict_step(self, variables, batch):
            self.log("foo", 1.0)
            return super().predict_step(variables, batch)

    with pytest.raises(RuntimeError, match=r"in predict_step\(\).*does not allow logging"):
        quiet_trainer().predict(LogsInPredict(init_variables=init_mlp()), loader(VX, VY, 8))


# ---------------------------------------------- only what the module logged
def test_training_step_log_reports_only_what_was_logged(tmp_path):
    # trainer/logging_/test_train_loop_logging.py::test__training_step__log
    def train(m):
        loss = jnp.float32(0.5)
        m.log("default", loss)
        m.log("l_s", loss, on_step=True, on_epoch=False, prog_bar=False, logger=True)
        m.log("l_e", loss, on_step=False, on_epoch=True, prog_bar=False, logger=True)
        m.log("l_se", loss, on_step=True, on_epoch=True, prog_bar=False, logger=True)
        m.log("p_s", loss, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        m.log("p_e", loss, on_step=False, on_epoch=True, prog_bar=True, logger=False)
        m.log("p_se", loss, on_step=True, on_epoch=True, prog_bar=True, logger=False)

    class Plain(Logs):  # LitMLP logs "acc": this one only what the test logs
        def loss(self, variables, batch, rngs):
            self.train_logs(self)
            x, y = batch
            logits = self.net.apply(variables, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    trainer = lightning_trainer(
        default_root_dir=tmp_path,
        limit_train_batches=2,
        max_epochs=2,
        log_every_n_steps=1,
        callbacks=[jl.ModelCheckpoint(monitor="l_se")],
    )
    trainer.fit(Plain(train=train), loader(X, Y, 16))
    logged = set(trainer.logged_metrics)
    assert logged == {"default", "l_e", "l_s", "l_se_step", "l_se_epoch"}
    bar = set(trainer.progress_bar_metrics)
    assert bar == {"p_e", "p_s", "p_se_step", "p_se_epoch"}
    assert set(trainer.callback_metrics) == logged | bar | {"p_se", "l_se"}
    assert all(isinstance(v, float) for v in trainer.progress_bar_metrics.values())


def test_training_step_and_epoch_end_log_report_only_what_was_logged(tmp_path):
    # trainer/logging_/test_train_loop_logging.py::test__training_step__epoch_end__log
    def train(m):
        loss = jnp.float32(0.25)
        m.log("a", loss, on_step=True, on_epoch=True)
        m.log_dict({"a1": loss, "a2": loss})

    def at_epoch_end(m):
        m.log("b1", 1.0)
        m.log("b", 2.0, on_epoch=True, prog_bar=True, logger=True)

    module = Logs(train=train, host={"on_train_epoch_end": at_epoch_end})
    trainer = lightning_trainer(
        default_root_dir=tmp_path, limit_train_batches=2, max_epochs=2, log_every_n_steps=1
    )
    trainer.fit(module, loader(X, Y, 16))
    logged = set(trainer.logged_metrics)  # LitMLP's own loss() logs "acc"
    assert logged == {"a_step", "a_epoch", "b", "b1", "a1", "a2", "acc"}
    assert set(trainer.progress_bar_metrics) == {"b"}
    assert set(trainer.callback_metrics) == logged | {"a"}


def test_log_loss_reports_what_loss_returns_as_train_loss():
    """Trainer(log_loss=True), ours: what loss() returns is reported as
    train/loss (the interval's mean) in every collection; a name of the
    module's own under it is then refused."""
    trainer = lightning_trainer(max_epochs=1, log_every_n_steps=1, log_loss=True)
    trainer.fit(LitMLP(lr=0.0, init_variables=init_mlp()), loader(X[:16], Y[:16], 16))
    logits = np_logits(init_mlp()["params"], X[:16])
    expected = np_cross_entropy(logits, Y[:16]).mean()
    for values in (trainer.callback_metrics, trainer.logged_metrics):
        assert values["train/loss"] == pytest.approx(expected, rel=1e-5)
    assert "train/loss" in trainer.progress_bar_metrics
    module = Logs(train=lambda m: m.log("train/loss", 1.0))
    with pytest.raises(ValueError, match=r"'train/loss'.*log_loss=True"):
        lightning_trainer(max_steps=1, log_loss=True).fit(module, loader(X, Y, 16))
    free = lightning_trainer(max_steps=1)  # the name is the module's by default
    free.fit(module, loader(X, Y, 16))
    assert free.callback_metrics["train/loss"] == 1.0


def test_a_checkpoint_resumes_whether_or_not_the_loss_is_reported(tmp_path):
    """The step keeps its loss under one name either way (``log_loss`` changes
    only what is reported), so a checkpoint of one setting resumes under the
    other (a two-process job resumed by one process with another setting
    failed: its accumulators did not match)."""
    ckpt = jl.ModelCheckpoint(tmp_path, every_n_train_steps=2)
    lightning_trainer(max_steps=2, callbacks=[ckpt]).fit(LitMLP(), loader(X, Y, 16))
    resumed = lightning_trainer(max_steps=4, log_loss=True, log_every_n_steps=1)
    resumed.fit(LitMLP(), loader(X, Y, 16), ckpt_path=str(tmp_path / "2"))
    assert resumed.global_step == 4 and "train/loss" in resumed.callback_metrics


# --------------------------------------------------------------- reductions
def test_sum_of_a_scalar_counts_once_per_step():
    # trainer/logging_/test_train_loop_logging.py::test_logging_sync_dist_true (devices=1):
    # limit_train_batches=3, limit_val_batches=3, a constant logged with reduce_fx="sum"
    def train(m):
        m.log("foo_2", 2.0, on_step=True, on_epoch=False, reduce_fx="sum")
        m.log("foo_3", 2.0, on_step=True, on_epoch=False, reduce_fx="mean")
        m.log("foo_7", 2.0, on_step=False, on_epoch=True, reduce_fx="sum")
        m.log("foo_8", 2.0, on_step=False, on_epoch=True, reduce_fx="mean")
        m.log("ones", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        # the global step before this update is the batch's index (one epoch)
        m.log("foo_11", m.global_step * 1.0, on_step=True, on_epoch=True, reduce_fx="mean")

    def val(m):
        m.log("bar", 1.0, reduce_fx="sum")
        m.log("bar_2", 1.0, reduce_fx="mean")

    trainer = lightning_trainer(
        max_epochs=1, limit_train_batches=3, limit_val_batches=3, log_every_n_steps=1
    )
    # batch 2 on 8 devices: 6 of 8 devices hold only padding rows
    trainer.fit(Logs(train=train, val=val), loader(X, Y, 2), loader(VX, VY, 2))
    metrics = trainer.callback_metrics
    assert metrics["foo_2"] == 2
    assert metrics["foo_3"] == 2
    assert metrics["foo_7"] == 2 * 3
    assert metrics["foo_8"] == 2
    assert metrics["ones"] == 3  # the case: not once per row (6)
    assert metrics["foo_11_step"] == 2  # the last step's own value, not the interval's
    assert metrics["foo_11"] == 1  # the epoch's mean of 0, 1, 2
    assert metrics["bar"] == 1 * 3
    assert metrics["bar_2"] == 1


@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [("avg", 2.5), ("SUM", 10.0), ("Max", 4.0), (max, 4.0), (min, 1.0), (np.mean, 2.5)],
)
def test_reduce_fx_aliases_and_functions_as_lightning_reads_them(reduce_fx, expected):
    # core/test_metric_result_integration.py (_Metadata reads "avg"/"SUM" and
    # torch.max or Python's max) and test_logging_sync_dist_true's reduce_fx="SUM"
    # four batches of one row each, every feature the batch's number
    values = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    xs = np.repeat(values[:, None], VX.shape[1], axis=1)

    class Rows(LitMLP):
        def eval_step(self, variables, batch):
            x, _ = batch
            self.log("foo", x[:, 0].mean(), reduce_fx=reduce_fx)

    (result,) = lightning_trainer().validate(
        Rows(init_variables=init_mlp()), loader(xs, np.zeros(4, np.int32), 1)
    )
    assert result["foo"] == pytest.approx(expected)


def test_reduce_fx_that_the_devices_cannot_run_is_refused():
    module = Logs(val=lambda m: m.log("foo", 1.0, reduce_fx=np.median))
    with pytest.raises(ValueError, match="reduce_fx=.*median.*use one of"):
        lightning_trainer().validate(module, loader(VX, VY, 8))


def test_a_non_scalar_array_logged_in_a_host_hook_raises_value_error():
    # trainer/logging_/test_eval_loop_logging.py: Lightning raises ValueError
    # for a tensor with more than one element
    import torch

    module = Logs(
        init_variables=init_mlp(),
        host={"on_validation_epoch_end": lambda m: m.log("v", torch.tensor([1.0, 2.0]))},
    )
    with pytest.raises(ValueError, match=r"'v'.*array of shape \(2,\)"):
        lightning_trainer().validate(module, loader(VX, VY, 8))


def test_add_dataloader_idx_false_keeps_the_names_as_written():
    # trainer/logging_/test_eval_loop_logging.py: add_dataloader_idx=False
    def val(m):
        m.log("plain", 1.0, add_dataloader_idx=False)

    results = lightning_trainer().validate(
        Logs(init_variables=init_mlp(), val=val), [loader(VX, VY, 8), loader(VX, VY, 8)]
    )
    assert "plain" in results[0] and "plain" in results[1]
    assert "acc/dataloader_idx_0" in results[0] and "acc/dataloader_idx_1" in results[1]


# -------------------------------------------------------------- logger steps
def test_logger_steps_follow_lightnings_numbering(tmp_path):
    # trainer/logging_/test_train_loop_logging.py::test_log_metrics_epoch_step_values
    logger = jl.CSVLogger(str(tmp_path))
    trainer = lightning_trainer(
        max_epochs=2, limit_train_batches=2, log_every_n_steps=1, logger=logger
    )
    module = Logs(train=lambda m: m.log("foo", 0.0, on_step=True, on_epoch=True))
    trainer.fit(module, loader(X, Y, 16))
    rows = _csv_rows(logger)
    steps = [(int(r["step"]), int(float(r["epoch"]))) for r in rows if r.get("foo_step")]
    epochs = [(int(r["step"]), int(float(r["epoch"]))) for r in rows if r.get("foo_epoch")]
    assert steps == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert epochs == [(1, 0), (3, 1)]


# ------------------------------------------------------ results and resets
def test_validate_returns_values_logged_in_on_validation_epoch_end():
    # trainer/logging_/test_eval_loop_logging.py: epoch-end values are in the results
    def at_end(m):
        m.log("from_epoch_end", 3.0)

    module = Logs(init_variables=init_mlp(), host={"on_validation_epoch_end": at_end})
    results = lightning_trainer().validate(module, loader(VX, VY, 8))
    assert results[0]["from_epoch_end"] == 3.0 and "acc" in results[0]


def test_callback_metrics_are_reset_when_validate_starts():
    # trainer/trainer.py _run: reset_results() and reset_metrics() at every call
    trainer = lightning_trainer(max_steps=2)
    module = LitMLP()
    trainer.fit(module, loader(X, Y, 16))
    assert "acc" in trainer.callback_metrics
    (results,) = trainer.validate(module, loader(VX, VY, 8))
    assert trainer.callback_metrics == results
    assert set(results) == {"loss", "acc"}


def test_sum_of_a_scalar_is_independent_of_the_device_count():
    """With one device the same run gives the same numbers (a cross-check of the
    per-device weighting against the plain single-device meaning)."""
    one = jl.Trainer(
        devices=1, max_epochs=1, limit_train_batches=3, enable_progress_bar=False,
        logger=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    module = Logs(train=lambda m: m.log("ones", 1.0, on_step=False, on_epoch=True, reduce_fx="sum"))
    one.fit(module, loader(X, Y, 2))
    assert one.callback_metrics["ones"] == 3  # as logged, Lightning's name


def test_optax_is_untouched_by_logging():
    # logging in loss() changes nothing of the update (the values are auxiliary)
    variables = init_mlp()

    def train(m):
        m.log("ones", 1.0, reduce_fx="sum")
        m.log("epoch", m.current_epoch * 1.0)

    plain, logged = LitMLP(init_variables=variables), Logs(train=train, init_variables=variables)
    for module in (plain, logged):
        quiet_trainer(max_steps=3, seed=1).fit(module, loader(X, Y, 16))
    for a, b in zip(
        jax.tree.leaves(plain.variables), jax.tree.leaves(logged.variables), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class Named(LitMLP):
    """Logs Lightning-style names: ``train_acc`` in training, ``val_loss`` and
    ``val_acc`` in evaluation."""

    def loss(self, variables, batch, rngs):
        logits = self.net.apply(variables, batch[0])
        self.log("train_acc", logits.argmax(-1) == batch[1])
        return super().loss(variables, batch, rngs)

    def eval_step(self, variables, batch):
        x, y = batch
        logits = self.net.apply(variables, x)
        self.log("val_loss", optax.softmax_cross_entropy_with_integer_labels(logits, y))
        self.log("val_acc", logits.argmax(-1) == y)


def _named_fit(tmp_path, **kwargs):
    checkpoint = jl.ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    stopping = jl.EarlyStopping(monitor="val_acc", mode="max", patience=10)
    trainer = jl.Trainer(
        max_epochs=2, enable_progress_bar=False, logger=False, enable_model_summary=False,
        callbacks=[checkpoint, stopping], log_every_n_steps=1, **kwargs,
    )  # fmt: skip
    trainer.fit(Named(), loader(X, Y, 16), loader(X[:32], Y[:32], 16))
    return trainer, checkpoint


def test_names_are_reported_as_logged_and_lightning_monitors_work_unchanged(tmp_path):
    """Lightning's rule (no stage prefix added): ModelCheckpoint(monitor="val_loss")
    and EarlyStopping(monitor="val_acc") from a Lightning script find their values;
    the Trainer adds nothing the module did not log."""
    trainer, checkpoint = _named_fit(tmp_path)
    assert set(trainer.callback_metrics) == {"acc", "train_acc", "val_loss", "val_acc"}
    assert not any(k.startswith(("val/", "test/")) for k in trainer.callback_metrics)
    assert checkpoint.best_model_score == pytest.approx(trainer.callback_metrics["val_loss"])
    (result,) = trainer.validate(Named(), loader(X[:32], Y[:32], 16), ckpt_path="best")
    assert set(result) == {"val_loss", "val_acc"}


def test_stage_prefix_groups_names_by_stage(tmp_path):
    """Trainer(stage_prefix=True): train/, val/, test/ before a name that does not
    carry its stage already (val_loss stays)."""
    trainer = jl.Trainer(
        max_epochs=1, enable_progress_bar=False, logger=False, enable_model_summary=False,
        enable_checkpointing=False, log_every_n_steps=1, stage_prefix=True,
    )  # fmt: skip
    module = Logs(train=lambda m: m.log("foo", 1.0), val=lambda m: m.log("bar", 2.0))
    trainer.fit(module, loader(X, Y, 16), loader(X[:16], Y[:16], 16))
    assert {"train/foo", "train/acc", "val/bar", "val/acc", "val/loss"} <= set(
        trainer.callback_metrics
    )
    (tested,) = trainer.test(module, loader(X[:16], Y[:16], 16))
    assert set(tested) == {"test/bar", "test/acc", "test/loss"}


def test_torch_scalars_logged_from_a_host_hook(tmp_path):
    """Lightning code logs torch tensors from host hooks (on_validation_epoch_end),
    integer ones too; an integer torch scalar used to fail the numeric check."""
    import torch

    def at_end(m):
        m.log("count", torch.tensor(3))
        m.log("ratio", torch.tensor(0.5))
        m.log("flag", torch.tensor(True))

    module = Logs(init_variables=init_mlp(), host={"on_validation_epoch_end": at_end})
    (result,) = lightning_trainer().validate(module, loader(VX, VY, 8))
    assert (result["count"], result["ratio"], result["flag"]) == (3.0, 0.5, 1.0)


def test_logging_neither_per_step_nor_per_epoch_from_a_callback_hook_raises():
    """Lightning refuses on_step=False, on_epoch=False wherever self.log is called
    (its logger connector's result metadata: "is not useful"), a callback's
    batch hook included."""

    class LogsNothing(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            module.log("nothing", 1.0, on_step=False, on_epoch=False)

    trainer = lightning_trainer(max_steps=1, callbacks=[LogsNothing()])
    with pytest.raises(ValueError, match=r"on_step=False, on_epoch=False\) would report nothing"):
        trainer.fit(LitMLP(), loader(X, Y, 16))


# -------------------------------------------------------- evaluation hooks
def test_each_loader_passes_its_dataloader_idx():
    # trainer/dynamic_args/test_multiple_eval_dataloaders.py::test_multiple_eval_dataloaders_seq:
    # validation_step(batch, batch_idx, dataloader_idx) branches on the index
    # (a Python int here: each loader is its own compiled program).
    (ax, ay), (bx, by) = digits(24, 500), digits(40, 900)
    seen = []

    class Branches(LitMLP):
        def validation_step(self, variables, batch, dataloader_idx):
            seen.append(dataloader_idx)
            x, y = batch
            logits = self.net.apply(variables, x)
            name = "first_acc" if dataloader_idx == 0 else "second_acc"
            self.log(name, logits.argmax(-1) == y, add_dataloader_idx=False)

    variables = init_mlp()
    results = lightning_trainer().validate(
        Branches(init_variables=variables), [loader(ax, ay, 8), loader(bx, by, 16)]
    )
    assert set(seen) == {0, 1}
    assert list(results[0]) == ["first_acc"] and list(results[1]) == ["second_acc"]
    for got, (x, y) in zip(
        (results[0]["first_acc"], results[1]["second_acc"]), ((ax, ay), (bx, by)), strict=True
    ):
        expected = (np_logits(variables["params"], x).argmax(-1) == y).mean()
        assert got == pytest.approx(expected)


def test_one_loader_passes_no_dataloader_idx_and_a_silent_step_is_allowed():
    # BoringModel's validation_step logs nothing (Lightning allows it, and passes no
    # dataloader_idx with one loader: the default stays).
    class Silent(LitMLP):
        def validation_step(self, variables, batch, dataloader_idx=7):
            assert dataloader_idx == 7

    trainer = lightning_trainer(max_epochs=1)
    trainer.fit(Silent(), loader(X, Y, 16), loader(VX, VY, 8))
    assert trainer.global_step == 4
    assert "acc" in trainer.callback_metrics  # training's values only
    assert trainer.validate(Silent(), loader(VX, VY, 8)) == [{}]


def test_on_step_in_validation_logs_each_batch_and_the_epoch(tmp_path):
    # trainer/logging_/test_eval_loop_logging.py::test_eval_logging_auto_reduce and
    # ::test__validation_step__log: val_loss logged on_step and on_epoch gives
    # val_loss_step per batch (at the batch's index), val_loss_epoch and val_loss;
    # callback_metrics holds no step values of an evaluation.
    variables = init_mlp()
    vx, vy = digits(20, 500)  # batches of 8, 8, 4

    class PerBatch(LitMLP):
        def validation_step(self, variables, batch):
            x, y = batch
            logits = self.net.apply(variables, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            self.log("val_loss", loss, on_step=True, on_epoch=True, prog_bar=True)

    logger = jl.CSVLogger(str(tmp_path))
    trainer = lightning_trainer(logger=logger)
    results = trainer.validate(PerBatch(init_variables=variables), loader(vx, vy, 8))
    losses = np_cross_entropy(np_logits(variables["params"], vx), vy)
    batch_means = [losses[:8].mean(), losses[8:16].mean(), losses[16:].mean()]
    assert set(trainer.callback_metrics) == {"val_loss", "val_loss_epoch"}
    assert trainer.callback_metrics["val_loss"] == pytest.approx(losses.mean(), rel=1e-5)
    assert trainer.logged_metrics["val_loss_epoch"] == pytest.approx(losses.mean(), rel=1e-5)
    assert trainer.logged_metrics["val_loss_step"] == pytest.approx(batch_means[-1], rel=1e-5)
    assert results[0]["val_loss_epoch"] == pytest.approx(losses.mean(), rel=1e-5)
    logger.save()
    rows = [r for r in _csv_rows(logger) if r.get("val_loss_step")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    got = [float(r["val_loss_step"]) for r in rows]
    np.testing.assert_allclose(got, batch_means, rtol=1e-5)


class EvalPerBatch(LitMLP):
    """Logs its evaluation loss per batch and per run, and a value kept from
    the loggers."""

    def eval_step(self, variables, batch):
        x, y = batch
        loss = optax.softmax_cross_entropy_with_integer_labels(self.net.apply(variables, x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.log("hidden", 1.0, logger=False)


def test_a_fits_validations_log_their_batches_at_steps_counted_across_them(tmp_path):
    # Lightning's _EvaluationLoop: update_eval_step_metrics(_seen_batches_per_dataloader[i]),
    # reset only when the loaders are set up again (once per fit); the sanity
    # check's batches are not logged. Checked against Lightning 2.6 itself.
    logger = jl.CSVLogger(str(tmp_path))
    trainer = lightning_trainer(logger=logger, max_epochs=2, num_sanity_val_steps=2)
    trainer.fit(EvalPerBatch(), loader(X[:24], Y[:24], 8), loader(VX, VY, 8))
    logger.save()
    steps = [int(r["step"]) for r in _csv_rows(logger) if r.get("loss_step")]
    assert steps == [0, 1, 2, 3, 4, 5]  # 3 batches per validation, two validations
    trainer.validate(trainer.lightning_module, loader(VX, VY, 8))  # a new call: from 0
    logger.save()
    steps = [int(r["step"]) for r in _csv_rows(logger) if r.get("loss_step")]
    assert steps[6:] == [0, 1, 2]


def test_test_returns_the_logged_values_under_the_loggers_names():
    # What Lightning 2.6 returns (checked): per loader, the values logged with
    # logger=True, named as the loggers get them (the level, then the loader:
    # `loss_epoch/dataloader_idx_0`); callback_metrics also has the plain names.
    module = EvalPerBatch(init_variables=init_mlp())
    trainer = lightning_trainer()
    results = trainer.test(module, [loader(VX, VY, 8), loader(VX[:8], VY[:8], 8)])
    assert [set(r) for r in results] == [
        {"loss_epoch/dataloader_idx_0"},
        {"loss_epoch/dataloader_idx_1"},
    ]
    (single,) = trainer.test(module, loader(VX, VY, 8))
    assert set(single) == {"loss_epoch"}
    assert set(trainer.callback_metrics) == {"loss", "loss_epoch", "hidden"}


class LogsInEvalBatchHooks(LitMLP):
    def on_validation_batch_end(self, batch_idx):
        self.log("hook_mean", float(batch_idx))  # eval defaults: on_epoch only
        self.log("hook_step", float(batch_idx) * 10, on_step=True, on_epoch=False)


def test_values_logged_in_evaluation_batch_hooks_as_lightning(tmp_path):
    # Checked against Lightning 2.6 run here (validate, 3 batches of 8): the
    # hook's default value is the loader's mean (1.0, not the last 2.0); a step
    # value goes to the loggers at each batch's evaluation step only; with two
    # loaders each gets its own suffixed mean.
    logger = jl.CSVLogger(str(tmp_path))
    trainer = lightning_trainer(logger=logger)
    module = LogsInEvalBatchHooks(init_variables=init_mlp())
    (result,) = trainer.validate(module, loader(VX, VY, 8))
    assert set(result) == set(trainer.callback_metrics) == {"hook_mean", "loss", "acc"}
    assert result["hook_mean"] == 1.0
    logger.save()
    steps = [(int(r["step"]), float(r["hook_step"])) for r in _csv_rows(logger) if r["hook_step"]]
    assert steps == [(0, 0.0), (1, 10.0), (2, 20.0)]
    results = trainer.validate(module, [loader(VX, VY, 8), loader(VX, VY, 8)])
    for i, values in enumerate(results):
        assert values[f"hook_mean/dataloader_idx_{i}"] == 1.0


def test_values_logged_in_on_test_epoch_end_reach_the_loggers_with_the_tests(tmp_path):
    # Lightning's _EvaluationLoop.on_run_end: the epoch-end hook's values and the
    # loader's go out in one log_eval_end_metrics call (one CSV row here)
    logger = jl.CSVLogger(str(tmp_path))
    seen = {}

    def at_end(m):
        seen.update(m.trainer.callback_metrics)
        m.log("e", 3.0)

    module = Logs(init_variables=init_mlp(), host={"on_test_epoch_end": at_end})
    lightning_trainer(logger=logger).test(module, loader(VX, VY, 8))
    logger.save()
    (row,) = _csv_rows(logger)
    assert float(row["e"]) == 3.0 and row["acc"] and row["loss"]
    assert {"acc", "loss"} <= set(seen)  # the hook already saw the loader's values


def test_a_name_built_from_the_trainers_stage_follows_each_call(compiles):
    # A validation step compiled during fit is not reused by validate() when
    # the names it logs depend on the call (Lightning's hooks run each time).
    class ByStage(LitMLP):
        def eval_step(self, variables, batch):
            self.log(f"acc_{self.trainer.stage}", 1.0)

    module = ByStage()
    trainer = lightning_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, loader(X, Y, 16), loader(VX, VY, 8))
    assert "acc_fit" in trainer.callback_metrics
    (result,) = trainer.validate(module, loader(VX, VY, 8))
    assert set(result) == {"acc_validate"}
    (result,) = trainer.validate(module, loader(VX, VY, 8))  # the same call: reused
    assert compiles.matching("jl_eval_step") == 2


def _batch_hook_logs(log, root, lightning):
    """What ``log(module_or_pl_module, batch_idx)`` in the training batch hooks
    sends to a CSVLogger and leaves in ``callback_metrics``: (step, name,
    value) triples and the final values, with Lightning or the Trainer."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    rows = TensorDataset(torch.randn(14, 64), torch.zeros(14, dtype=torch.long))
    data = DataLoader(rows, batch_size=4)  # 4, 4, 4 and 2 rows: the epoch mean is weighted
    if lightning:
        import lightning as L

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(64, 1)

            def training_step(self, batch, batch_idx):
                return self.layer(batch[0]).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def on_train_batch_start(self, batch, batch_idx):
                log(self, batch_idx, "start")

        class Callback(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                log(module, batch_idx, "end")

        logger = L.pytorch.loggers.CSVLogger(root, name="lightning")
        trainer = L.Trainer(
            max_epochs=2, log_every_n_steps=2, logger=logger, callbacks=[Callback()],
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(Module(), data)
        path = logger.experiment.metrics_file_path
    else:

        class Module(LitMLP):
            def on_train_batch_start(self, batch_idx):
                log(self, batch_idx, "start")

        class Callback(jl.Callback):
            def on_train_batch_end(self, trainer, module, batch_idx):
                log(module, batch_idx, "end")

        logger = jl.CSVLogger(root, name="ours")
        trainer = lightning_trainer(
            max_epochs=2, log_every_n_steps=2, logger=logger, callbacks=[Callback()]
        )
        trainer.fit(Module(), data)
        path = logger.metrics_file_path
    with open(path, newline="") as f:
        sent = {
            (int(r["step"]), name, round(float(value), 5))  # Lightning means in float32
            for r in csv.DictReader(f)
            for name, value in r.items()
            if value and name.startswith(("start", "end"))
        }
    metrics = trainer.callback_metrics.items()
    final = {k: round(float(v), 5) for k, v in metrics if k.startswith(("start", "end"))}
    return sent, final


@pytest.mark.parametrize(
    "options",
    [{}, {"on_step": False, "on_epoch": True}, {"on_step": True, "on_epoch": True}],
    ids=["default", "epoch", "both"],
)
def test_batch_hook_logs_reach_the_loggers_as_in_lightning(tmp_path, options):
    """``self.log`` in on_train_batch_start/end (the module's, a callback's):
    step values at the logging interval, the epoch's row-weighted mean at its
    end, ``_step``/``_epoch`` with both; run by Lightning itself and by the
    Trainer on the same 14-row loader, 2 epochs of 4 batches, a log every 2."""

    def log(module, batch_idx, where):
        module.log(where, float(batch_idx) + (0.5 if where == "end" else 0.0), **options)

    theirs = _batch_hook_logs(log, str(tmp_path), lightning=True)
    ours = _batch_hook_logs(log, str(tmp_path), lightning=False)
    assert ours == theirs
    if options.get("on_epoch"):  # (0*4 + 1*4 + 2*4 + 3*2) / 14 rows
        epoch = "end_epoch" if options.get("on_step") else "end"
        assert ours[1][epoch] == round(18 / 14 + 0.5, 5)
