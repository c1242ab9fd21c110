"""More bad input, each met with an error that names what is wrong and what to do
(cases found by a run of bad inputs), and a model summary of any pytree."""

import jax.numpy as jnp
import optax
import pytest
import torch
from flax import nnx

import jaxlightning as jl
from jaxlightning.io.checkpoint import _optimizer_change
from jaxlightning.loggers.base import finalize_all
from tests.helpers import MLP, LitMLP, digits, loader, quiet_trainer


class ListParams(jl.JaxModule):
    """A linear classifier whose parameters are a Python list of arrays."""

    def setup(self, rng, batch):
        return {"params": {"layers": [jnp.zeros((64, 10)), jnp.zeros(10)]}}

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def loss(self, variables, batch, rngs):
        w, b = variables["params"]["layers"]
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y)


def test_model_summary_lists_parameters_held_in_lists(capsys):
    summary = jl.callbacks.ModelSummary()
    quiet_trainer(max_steps=1, callbacks=[summary]).fit(ListParams(), loader(*digits(16), 8))
    assert "| layers/0 | (64, 10) | float32 | 640  |" in summary.summary
    assert "| layers/1 | (10,)    | float32 | 10   |" in summary.summary
    assert "Total: 650" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("batch", "named"),
    [
        ((torch.zeros(8, 64), None), r"batch\[1\] is None"),
        ({"x": torch.zeros(8, 64), "y": None}, r"batch\['y'\] is None"),
    ],
)
def test_none_in_a_batch_is_named_with_what_to_do(batch, named):
    with pytest.raises(jl.BatchError, match=named + r".*Leave the entry out of the batch"):
        quiet_trainer(max_steps=1).fit(LitMLP(), [batch])


def test_ema_added_when_resuming_a_checkpoint_saved_without_it(tmp_path):
    data = loader(*digits(16), 8)
    quiet_trainer(max_steps=1, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        LitMLP(hidden=8), data
    )
    resumed = quiet_trainer(
        max_steps=2,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        callbacks=[jl.callbacks.EMA(0.9)],
    )
    with pytest.raises(
        jl.CheckpointError,
        match=r"saved without an EMA callback, and this Trainer has one.*remove EMA from "
        r"callbacks.*load_from_checkpoint\(path\).*without ckpt_path",
    ):
        resumed.fit(LitMLP(hidden=8), data, ckpt_path="last")


def test_ema_removed_or_another_optimizer_is_named_from_the_shapes():
    plain = {
        "state/params/w": (3,),
        "state/opt_state/0/mu/w": (3,),
        "state/opt_state/0/count": (),
        "state/step": (),
    }
    with_ema = {
        "state/params/w": (3,),
        "state/opt_state/0/0/mu/w": (3,),
        "state/opt_state/0/0/count": (),
        "state/opt_state/1/ema/w": (3,),
        "state/step": (),
    }
    assert "saved without an EMA callback" in _optimizer_change("ckpt", plain, with_ema)
    removed = _optimizer_change("ckpt", with_ema, plain)
    assert "saved with an EMA callback, which this Trainer lacks: add EMA(...)" in removed
    sgd = {"state/params/w": (3,), "state/step": ()}
    other = _optimizer_change("ckpt", plain, sgd)
    assert other.startswith("checkpoint ckpt does not fit this optimizer: its parameters fit")
    assert "'state/opt_state/0/count'" in other and "Resume with the same optimizer" in other
    stateless = _optimizer_change("ckpt", {"state/params/w": (3,), "state/step": ()}, plain)
    assert "holds no optimizer state" in stateless and "load_from_checkpoint" in stateless
    other_model = {**plain, "state/params/w": (4,)}
    assert _optimizer_change("ckpt", plain, other_model) is None  # a plain shape mismatch


class OneOptimizer(jl.JaxModule):
    """Manual optimization with a single optimizer, stepped with a group name."""

    def __init__(self):
        super().__init__()
        self.net = MLP(8)

    def setup(self, rng, batch):
        return self.net.init(rng, batch[0])

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def training_step(self, optimizers, batch, rngs):
        x, y = batch

        def loss(params):
            logits = self.net.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

        optimizers.step(loss, "net")


def test_a_group_name_with_a_single_optimizer_says_to_leave_it_out():
    with pytest.raises(
        KeyError,
        match=r"optimizers.step\(fn, 'net'\): configure_optimizers\(\) returned a single "
        r"optimizer.*call optimizers.step\(fn\) without a group",
    ):
        quiet_trainer(max_steps=1).fit(OneOptimizer(), loader(*digits(16), 8))


class FailingFinalize(jl.loggers.Logger):
    log_dir = "nowhere"

    def log_hyperparams(self, params):
        pass

    def log_metrics(self, metrics, step):
        pass

    def finalize(self):
        raise OSError("disk full")


def test_a_failing_logger_does_not_keep_the_others_from_finalizing(tmp_path):
    csv_logger = jl.loggers.CSVLogger(tmp_path)
    csv_logger.log_metrics({"loss": 1.0}, step=1)
    with (
        pytest.warns(UserWarning, match=r"FailingFinalize.finalize\(\) failed: disk full"),
        pytest.raises(OSError, match="disk full"),  # the first failure; the second warns
    ):
        finalize_all([FailingFinalize(), csv_logger, FailingFinalize()])
    metrics = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    assert metrics.read_text().startswith("step,loss")  # written after the failure
    with pytest.warns(UserWarning, match=r"FailingFinalize.finalize\(\) failed: disk full"):
        finalize_all([FailingFinalize()], quiet=True)  # a run already failing: a warning


def test_the_trainer_finalizes_every_logger_when_one_fails(tmp_path):
    csv_logger = jl.loggers.CSVLogger(tmp_path)
    loggers = [FailingFinalize(), csv_logger]
    trainer = quiet_trainer(max_steps=2, log_every_n_steps=1, logger=loggers)
    with pytest.raises(OSError, match="disk full"):
        trainer.fit(LitMLP(hidden=8), loader(*digits(16), 8))
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").exists()


KERNEL = "params/Dense_0/kernel of shape"


@pytest.mark.parametrize(
    ("dim", "hidden", "error", "named"),
    [
        (5, 8, ValueError, rf"returned 5 for {KERNEL} \(64, 8\), which has dimensions 0 to 1; "
         "return one of them, or None to keep the array whole"),
        ("0", 8, TypeError, rf"returned '0' for {KERNEL} \(64, 8\): return a dimension index "
         r"\(an int\), or None"),
        (-3, 8, ValueError, rf"returned -3 for {KERNEL} \(64, 8\), which has dimensions 0 to 1"),
        (-1, 12, ValueError, rf"returned -1 for {KERNEL} \(64, 12\): its size 12 does not "
         "split evenly over the 8 devices; return another dimension"),
    ],
)  # fmt: skip
def test_fsdp_shard_dim_names_the_parameter_its_shape_and_the_bad_value(dim, hidden, error, named):
    def shard_dim(path, shape):
        return dim if path == "params/Dense_0/kernel" else None

    trainer = quiet_trainer(max_steps=1, strategy=jl.FSDPStrategy(shard_dim=shard_dim))
    with pytest.raises(error, match=r"FSDPStrategy\(shard_dim=...\) " + named):
        trainer.fit(LitMLP(hidden=hidden), loader(*digits(16), 8))


class NnxNet(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(64, 10, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.dense(x)


class NnxBase(jl.JaxModule):
    def configure_optimizers(self):
        return optax.sgd(0.1)


def test_nnx_model_with_the_linen_loss_signature_says_which_it_takes():
    class LinenLoss(NnxBase):
        def __init__(self):
            super().__init__()
            self.model = NnxNet()

        def loss(self, variables, batch, rngs):
            return jnp.zeros(())

    with pytest.raises(
        TypeError,
        match=r"LinenLoss.loss\(self, variables, batch, rngs\) has linen's signature, but "
        r"LinenLoss trains the NNX model self.model: here it is loss\(self, model, batch\)",
    ):
        quiet_trainer(max_steps=1).fit(LinenLoss(), loader(*digits(16), 8))


def test_nnx_model_not_kept_as_self_model_says_where_to_keep_it():
    class Elsewhere(NnxBase):
        def __init__(self):
            super().__init__()
            self.net = NnxNet()

        def loss(self, model, batch):
            return jnp.zeros(())

    with pytest.raises(
        TypeError,
        match=r"Elsewhere holds an NNX model as self.net and defines no setup\(\); the Trainer "
        r"trains an NNX model kept as self.model. Assign it to self.model",
    ):
        quiet_trainer(max_steps=1).fit(Elsewhere(), loader(*digits(16), 8))


def test_a_process_started_by_srun_or_mpirun_counts_as_part_of_a_job(monkeypatch):
    from jaxlightning.cluster import distributed

    for name in ("JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert not distributed.launched()
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # sbatch alone (no srun step): one process
    assert not distributed.launched()
    for name, value in (
        ("SLURM_STEP_NODELIST", "n[1-2]"), ("SLURM_NTASKS", "2"), ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "0"),
    ):  # fmt: skip
        monkeypatch.setenv(name, value)
    assert distributed.launched()
    for name in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "123.0;tcp://10.0.0.1:4000")
    assert distributed.launched()
