"""`Tuner.scale_batch_size`: the largest batch whose compiled train step fits a
device's memory, found by compiling candidates (never running them)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, load_example, loader, quiet_trainer


def _peak(trainer, module, train, rows):
    """XLA's bytes of the step at ``rows`` (the same analysis the tuner reads),
    with the dataset's copy kept on the device beside it (64 rows of 64 float32
    features and an int32 label: ``data_on_device="auto"``)."""
    with trainer.train_cost_at(module, train) as cost:
        assert cost.resident == 64 * (64 * 4 + 4)
        return cost(rows).peak_bytes + cost.resident


@pytest.mark.slow
def test_power_and_binsearch_find_the_fitting_boundary_and_set_the_batch_size():
    trainer = quiet_trainer(devices=2, max_steps=1)
    module = LitMLP(hidden=64)
    module.batch_size = 16  # where Lightning's finder writes its result
    train = loader(*digits(64), 16)
    budget = _peak(trainer, module, train, 256)
    assert _peak(trainer, module, train, 512) > budget  # the step grows with the batch

    found = jl.Tuner(trainer).scale_batch_size(module, train, max_bytes=budget)
    assert found == 256 and module.batch_size == 256  # 2, 4, ..., 256 fit; 512 not
    assert trainer.state is None  # nothing ran, no state was built

    found = jl.Tuner(trainer).scale_batch_size(
        module, train, mode="binsearch", max_bytes=budget, init_val=3, margin=0.0
    )
    # the largest size (a multiple of the 2 devices) that fits: the next does not
    assert found % 2 == 0 and found >= 256
    assert _peak(trainer, module, train, found) <= budget
    assert _peak(trainer, module, train, found + 2) > budget
    # Lightning's default 5% safety margin, not rounded to the devices (a batch
    # is padded to a multiple of them), as batch_size_scaling.py's max(1, int(...))
    safe = jl.Tuner(trainer).scale_batch_size(
        module, train, mode="binsearch", max_bytes=budget, init_val=3
    )
    assert safe == int(found * 0.95) == module.batch_size
    trainer.fit(module, loader(*digits(64), safe))  # and it trains, a device padded
    assert trainer.global_step == 1
    # max_trials=0: no trial, the first size (Lightning's loop of no trials)
    assert jl.Tuner(trainer).scale_batch_size(module, train, init_val=5, max_trials=0) == 5
    assert module.batch_size == 5


def test_what_cannot_be_tuned_is_named():
    trainer = quiet_trainer(devices=2)
    train = loader(*digits(64), 16)
    with pytest.raises(ValueError, match="report no memory limit: pass .*max_bytes"):
        jl.Tuner(trainer).scale_batch_size(LitMLP(), train)
    with pytest.raises(ValueError, match="even a batch of init_val=2 does not fit"):
        jl.Tuner(trainer).scale_batch_size(LitMLP(), train, max_bytes=1000)
    with pytest.raises(ValueError, match='mode must be "power" or "binsearch"'):
        jl.Tuner(trainer).scale_batch_size(LitMLP(), train, mode="linear", max_bytes=10**9)
    pmap = quiet_trainer(devices=2, strategy="pmap")
    with pytest.raises(RuntimeError, match="no memory analysis .* 'pmap' strategy"):
        jl.Tuner(pmap).scale_batch_size(LitMLP(), train, max_bytes=10**9)


@pytest.mark.slow
def test_a_datamodule_gets_the_size_and_configure_optimizers_sees_the_trainer():
    """The GPT example under FSDP: its configure_optimizers sizes a schedule by
    trainer.estimated_stepping_batches, its DataModule holds batch_size."""
    gpt = load_example("gpt")
    trainer = quiet_trainer(strategy="fsdp", max_steps=10)
    datamodule = gpt.MarkovTokens(batch_size=8)
    found = jl.Tuner(trainer).scale_batch_size(
        gpt.LitGPT(), datamodule=datamodule, init_val=8, max_trials=3, max_bytes=2**40
    )
    assert found == 32 == datamodule.batch_size  # 8, 16, 32: the trials ran out


class _Digits(jl.DataModule):
    def __init__(self, batch_size=8):
        super().__init__()
        self.hparams = jl.AttributeDict(batch_size=batch_size)
        self.batch_size = batch_size

    def train_dataloader(self):
        return loader(*digits(64), self.batch_size)


def test_fast_dev_run_tunes_nothing():
    """Lightning's trainer/flags/test_fast_dev_run.py::test_skip_on_fast_dev_run_tuner:
    both finders are skipped under fast_dev_run, with a warning, and nothing changes."""
    module = LitMLP(hidden=16)
    module.batch_size = 8
    tuner = jl.Tuner(quiet_trainer(fast_dev_run=True))
    with pytest.warns(UserWarning, match="Skipping batch size scaler since `fast_dev_run`"):
        assert tuner.scale_batch_size(module, loader(*digits(32), 8), max_bytes=2**40) is None
    with pytest.warns(UserWarning, match="Skipping learning rate finder since `fast_dev_run`"):
        assert tuner.lr_find(module, loader(*digits(32), 8)) is None
    assert module.batch_size == 8 and module.variables is None


def test_every_holder_of_the_batch_size_gets_the_new_size():
    """As Lightning's lightning_setattr: the module's attribute and hparams,
    the datamodule's attribute and hparams."""
    module = LitMLP(hidden=64)
    module.hparams["batch_size"] = module.batch_size = 8
    datamodule = _Digits(batch_size=8)
    found = jl.Tuner(quiet_trainer(devices=2, max_steps=1)).scale_batch_size(
        module, datamodule=datamodule, init_val=8, max_trials=2, max_bytes=2**40
    )
    assert found == 16  # 8, 16: the trials ran out
    assert module.batch_size == module.hparams["batch_size"] == 16
    assert datamodule.batch_size == datamodule.hparams["batch_size"] == 16


class _LinearRegression(jl.JaxModule):
    """y = x·w, squared error per example, plain SGD at ``hparams.lr``."""

    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, rng, batch):
        return {"params": {"w": jnp.zeros((batch[0].shape[1],), jnp.float32)}}

    def configure_optimizers(self):
        return optax.sgd(self.hparams.lr)

    def loss(self, variables, batch, rngs):
        x, y = batch
        return (x @ variables["params"]["w"] - y) ** 2


def _numpy_range_test(x, y, batch, lrs, beta=0.98):
    """The smoothed losses of SGD on the same batches, at the given rates, as
    Lightning's _LRCallback smooths them: bias-corrected at the global step
    after the update (1-based), hence ``beta ** (step + 2)`` for 0-based steps."""
    w, average, smoothed = np.zeros(x.shape[1]), 0.0, []
    for step, lr in enumerate(lrs):
        xb, yb = x[step * batch : (step + 1) * batch], y[step * batch : (step + 1) * batch]
        error = xb.astype(np.float64) @ w - yb
        average = beta * average + (1 - beta) * np.mean(error**2)
        smoothed.append(average / (1 - beta ** (step + 2)))
        w = w - lr * np.mean(2 * error[:, None] * xb, axis=0)
    return smoothed


def test_lr_find_sweeps_a_traced_rate_in_one_compile_and_suggests_the_steepest_fall(
    compiles, tmp_path
):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30 * 16, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=len(x))).astype(np.float32)
    model = _LinearRegression(lr=0.123)
    trainer = quiet_trainer(devices=2)
    compiles.reset()
    finder = jl.Tuner(trainer).lr_find(
        model, loader(x, y, 16), min_lr=1e-4, max_lr=1.0, num_training=30, early_stop_threshold=None
    )
    assert compiles.matching("train_step") == 1  # every rate in one program
    lrs = finder.results["lr"]
    np.testing.assert_allclose(lrs, np.geomspace(1e-4, 1.0, 30), rtol=1e-6)
    expected = _numpy_range_test(x, y, 16, lrs)
    np.testing.assert_allclose(finder.results["loss"], expected, rtol=1e-4)
    gradient = np.gradient(np.asarray(expected[10:-1]))
    assert finder.suggestion() == pytest.approx(lrs[10 + int(np.argmin(gradient))])
    assert model.hparams.lr == finder.suggestion()  # update_attr
    assert model.variables is None  # the test trained a copy
    _check_plot(finder, tmp_path / "lr_find.png")


def _check_plot(finder, path):
    """Lightning's plot: the smoothed losses against the rates on a log axis,
    the suggestion marked on the curve; saved as a real PNG."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    figure = finder.plot(suggest=True)
    ax = figure.axes[0]
    curve, marker = ax.get_lines()
    np.testing.assert_array_equal(curve.get_xdata(), finder.results["lr"])
    np.testing.assert_array_equal(curve.get_ydata(), finder.results["loss"])
    assert ax.get_xscale() == "log"
    lr = finder.suggestion()
    assert list(marker.get_xdata()) == [lr]
    assert list(marker.get_ydata()) == [finder.results["loss"][finder.results["lr"].index(lr)]]
    figure.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lr_find_stops_when_the_loss_diverges_and_names_a_missing_rate():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40 * 8, 4)).astype(np.float32)
    y = (x @ np.ones(4)).astype(np.float32)
    model = _LinearRegression()
    finder = jl.Tuner(quiet_trainer(devices=1)).lr_find(
        model, loader(x, y, 8), min_lr=1e-3, max_lr=1e3, num_training=40, update_attr=False
    )
    assert 2 < len(finder.results["lr"]) < 40  # SGD diverges well before 1e3
    assert model.hparams.lr == 0.1

    class NoRate(_LinearRegression):
        def __init__(self):
            jl.JaxModule.__init__(self)

        def configure_optimizers(self):
            return optax.sgd(0.1)

    with pytest.raises(AttributeError, match="no learning rate on NoRate: looked for 'lr' and"):
        jl.Tuner(quiet_trainer()).lr_find(NoRate(), loader(x, y, 8))


def test_lr_find_with_accumulation_records_each_update():
    """tuner/test_lr_finder.py::test_accumulation_and_early_stopping: with
    accumulate_grad_batches=2 each record is an update (two batches)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40 * 8, 4)).astype(np.float32)
    y = (x @ np.ones(4)).astype(np.float32)
    model = _LinearRegression()
    finder = jl.Tuner(quiet_trainer(accumulate_grad_batches=2)).lr_find(
        model, loader(x, y, 8), min_lr=1e-6, max_lr=1e-2, num_training=20, early_stop_threshold=None
    )
    assert len(finder.results["lr"]) == len(finder.results["loss"]) == 20
    np.testing.assert_allclose(finder.results["lr"], np.geomspace(1e-6, 1e-2, 20), rtol=1e-6)
    assert finder.suggestion() is not None


def test_lr_find_accepts_swapped_bounds():
    """Lightning sweeps from min_lr to max_lr whichever is larger."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20 * 8, 4)).astype(np.float32)
    y = (x @ np.ones(4)).astype(np.float32)
    finder = jl.Tuner(quiet_trainer()).lr_find(
        _LinearRegression(), loader(x, y, 8), min_lr=1e-2, max_lr=1e-5, num_training=12,
        early_stop_threshold=None, update_attr=False,
    )  # fmt: skip
    np.testing.assert_allclose(finder.results["lr"], np.geomspace(1e-2, 1e-5, 12), rtol=1e-6)
