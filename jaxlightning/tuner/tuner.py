"""`Tuner`: the largest batch that fits, found from compiled programs alone.

Lightning's batch-size finder runs steps at growing sizes until CUDA runs out
of memory. Here each candidate's train step is only compiled, and XLA's
memory analysis of it (`jaxlightning.xla.cost`) says whether it fits: nothing runs,
nothing runs out of memory, and the trainer's state is left as it was.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxlightning import checks
from jaxlightning.cluster.rank_zero import rank_zero_info, rank_zero_warn
from jaxlightning.data.datamodule import is_datamodule
from jaxlightning.module import JaxModule
from jaxlightning.tuner.lr_finder import LRFinder, lr_find
from jaxlightning.xla import memory


class Tuner:
    """Tunes a `Trainer`'s run before it fits (Lightning's ``Tuner``).

    Args:
        trainer: the Trainer whose devices, strategy and options the candidate
            steps are compiled for.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def scale_batch_size(
        self,
        model: JaxModule,
        train_dataloaders: Any = None,
        datamodule: Any = None,
        *,
        mode: str = "power",
        init_val: int = 2,
        max_trials: int = 25,
        max_bytes: int | None = None,
        batch_arg_name: str = "batch_size",
        method: str = "fit",
        steps_per_trial: int = 3,
        margin: float = 0.05,
    ) -> int | None:
        """The largest global batch size whose compiled train step fits in each
        device's memory, set on the model (or datamodule) as ``batch_arg_name``
        where it has one (an attribute or a hyperparameter), and returned.

        Starting at ``init_val`` the size doubles while the step fits (at most
        ``max_trials`` compiles); ``mode="binsearch"`` then bisects between the
        last size that fit and the first that did not. Sizes are global, in
        multiples of the devices the batch is split over.

        Args:
            model: the module, as for `Trainer.fit`.
            train_dataloaders: a training loader (its first batch gives the
                shapes of a row), or None to use the datamodule's or the module's.
            datamodule: a `DataModule` giving the training loader.
            mode: ``"power"`` or ``"binsearch"``.
            init_val: the first size tried.
            max_trials: the most compiles (0: none, ``init_val`` is the size).
            max_bytes: one device's memory for the step (default: the smallest
                device's limit; required where devices report none, as on CPU).
            batch_arg_name: the attribute or hyperparameter to set.
            method: ``"fit"``: the train step is what is sized (Lightning's
                other methods size an evaluation loop; refused here).
            steps_per_trial: accepted for Lightning's signature: no step runs
                here, each candidate is only compiled.
            margin: with ``"binsearch"``, the size found is lowered by this
                fraction (Lightning's 5% safety margin: 8 becomes 7).

        Returns:
            The size, or ``None`` under ``fast_dev_run`` (nothing is tuned,
            with a warning, as in Lightning).
        """
        if self.trainer.fast_dev_run:
            rank_zero_warn("Skipping batch size scaler since `fast_dev_run` is enabled.")
            return None
        _check_search_args(method, margin, steps_per_trial, mode, init_val, max_trials)
        trainer = self.trainer
        if datamodule is None and is_datamodule(train_dataloaders):
            datamodule, train_dataloaders = train_dataloaders, None
        if max_trials == 0:  # no trial: the first size, as Lightning's loop of no trials
            _set_batch_size(model, datamodule, batch_arg_name, init_val)
            return init_val
        budget = max_bytes if max_bytes is not None else _device_limit(trainer.strategy.devices)
        # As fit does: the datamodule set up, the module's trainer set, the
        # epoch's batches known (configure_optimizers may size schedules by them).
        with trainer.train_cost_at(model, train_dataloaders, datamodule=datamodule) as cost:
            low = _search(
                cost,
                trainer.strategy,
                budget,
                resident=cost.resident,
                mode=mode,
                init_val=init_val,
                max_trials=max_trials,
            )
        if mode == "binsearch" and margin > 0:
            low = _less_margin(low, margin)
        _set_batch_size(model, datamodule, batch_arg_name, low)
        return low

    def memory_budget(
        self,
        model: JaxModule,
        train_dataloaders: Any = None,
        datamodule: Any = None,
        *,
        device_memory: int | None = None,
    ) -> memory.MemoryBudget | None:
        """One device's memory during ``model``'s train step, from XLA's analysis
        of the step compiled as `Trainer.fit` would compile it (nothing runs, no
        state is built): parameters, optimizer state, the rest of the state,
        the batch shard, temporaries and the peak, against ``device_memory``
        (default: the Trainer's, else what the devices report). Printed and
        returned; where it does not fit, with the smaller batch and more
        accumulation that fits. ``None`` where the backend analyses nothing."""
        trainer = self.trainer
        given = device_memory if device_memory is not None else trainer.args.device_memory
        limit = memory.device_limit(trainer.strategy.devices, given)
        if datamodule is None and is_datamodule(train_dataloaders):
            datamodule, train_dataloaders = train_dataloaders, None
        with trainer.train_cost_at(model, train_dataloaders, datamodule=datamodule) as sizing:
            found = sizing.budget(limit)
        if found is not None:
            rank_zero_info(found.table())
        return found

    def lr_find(
        self,
        model: JaxModule,
        train_dataloaders: Any = None,
        datamodule: Any = None,
        **settings: Any,
    ) -> LRFinder | None:
        """Lightning's learning-rate range test: steps with the rate growing from
        ``min_lr`` to ``max_lr``, the loss of each recorded, and the rate where
        it falls fastest suggested (`LRFinder.suggestion`) and, with
        ``update_attr``, set on the model.

        The rate is the module's ``lr`` or ``learning_rate`` (attribute or
        hyperparameter; ``attr_name`` names another), and for the test it is an
        optax schedule of the step: `configure_optimizers` must hand it to optax
        as it is (``optax.adam(self.hparams.lr)``), and the train step compiles
        once. The test trains a throwaway copy of the run (same devices,
        strategy, precision, clipping, seed); the module's variables and rate
        are put back.

        Args:
            model: the module, as for `Trainer.fit`.
            train_dataloaders: the training loader (or a `DataModule`).
            datamodule: a `DataModule` giving the training loader.
            **settings: Lightning's ``min_lr`` (1e-8), ``max_lr`` (1.0),
                ``num_training`` (100), ``mode`` (``"exponential"`` or
                ``"linear"``), ``early_stop_threshold`` (4.0: stop once the
                smoothed loss exceeds 4 times its best; ``None``: never),
                ``update_attr`` (True), ``attr_name`` (``""``), as
                `jaxlightning.tuner.lr_finder.lr_find` takes them.

        Returns:
            An `LRFinder`: ``results`` (rates and smoothed losses),
            ``suggestion()``, ``plot(suggest=True)`` (with matplotlib);
            ``None`` under ``fast_dev_run`` (nothing is tuned, with a warning).
        """
        if self.trainer.fast_dev_run:
            rank_zero_warn("Skipping learning rate finder since `fast_dev_run` is enabled.")
            return None
        if datamodule is None and is_datamodule(train_dataloaders):
            datamodule, train_dataloaders = train_dataloaders, None
        return lr_find(self.trainer, model, train_dataloaders, datamodule, **settings)


def _check_search_args(
    method: str, margin: float, steps_per_trial: int, mode: str, init_val: int, max_trials: int
) -> None:
    """Refuses `Tuner.scale_batch_size` arguments it cannot search with, before
    anything is compiled."""
    if method != "fit":
        raise ValueError(
            f"scale_batch_size(method={method!r}): only 'fit' is supported; the search "
            "sizes the compiled train step"
        )
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    checks.int_arg("steps_per_trial", steps_per_trial, minimum=1)
    if mode not in ("power", "binsearch"):
        raise ValueError(f'mode must be "power" or "binsearch", got {mode!r}')
    checks.int_arg("init_val", init_val, minimum=1)
    checks.int_arg("max_trials", max_trials, minimum=0)


def _less_margin(size: int, margin: float) -> int:
    """``size`` lowered by the fraction ``margin`` (at least 1), as a safety
    margin under the largest size that fit: Lightning's rule. Any size runs
    (a batch is padded to a multiple of the devices), so it is not rounded."""
    return max(int(size * (1 - margin)), 1)


def _search(
    cost_at: Any,
    strategy: Any,
    budget: int,
    *,
    resident: int,
    mode: str,
    init_val: int,
    max_trials: int,
) -> int:
    """The largest size whose step fits ``budget`` beside ``resident`` bytes of
    a dataset kept on the device (doubling, then bisecting for
    ``"binsearch"``), in at most ``max_trials`` compiles."""
    shards = strategy.num_local_shards

    def fits(size: int) -> bool:
        rows = -(-size // shards) * shards  # padded as the host path pads
        cost = cost_at(rows)
        if cost is None:
            raise RuntimeError(
                f"no memory analysis of the train step under the {strategy.name!r} "
                "strategy on this backend, so the batch size cannot be found without "
                "running out of memory; tune with strategy='auto'"
            )
        return cost.peak_bytes + resident <= budget

    size, trials = init_val, 1
    if not fits(size):
        beside = (
            f" beside the dataset's copy kept on it ({resident / 2**20:.4g} MiB; "
            "data_on_device=False leaves it on the host)"
            if resident
            else ""
        )
        raise ValueError(
            f"even a batch of init_val={init_val} does not fit {budget / 2**20:.4g} MiB per "
            f"device{beside}; lower init_val, or fit a smaller model (or shard it: "
            "strategy='fsdp')"
        )
    low, high = size, None  # the largest size that fits, the smallest that does not
    while trials < max_trials:
        trials += 1
        if fits(size * 2):
            size *= 2
            low = size
        else:
            high = size * 2
            break
    if mode == "binsearch" and high is not None:
        while high - low > shards and trials < max_trials:
            trials += 1
            middle = (low + high) // 2 // shards * shards
            if middle <= low:
                break
            if fits(middle):
                low = middle
            else:
                high = middle
    return low


def _device_limit(devices: list[jax.Device]) -> int:
    limit = memory.device_limit(devices)
    if limit is None:
        raise ValueError(
            f"{devices[0].platform} devices report no memory limit: pass "
            "scale_batch_size(..., max_bytes=...) with one device's memory for the step"
        )
    return limit


def _set_batch_size(model: Any, datamodule: Any, name: str, value: int) -> None:
    """Sets ``name`` on every holder Lightning's ``lightning_setattr`` sets: the
    model's attribute and hyperparameter, the datamodule's attribute and
    hyperparameter (each that has it)."""
    for owner in (model, datamodule):
        if owner is None:
            continue
        if hasattr(owner, name):
            setattr(owner, name, value)
        hparams = getattr(owner, "hparams", None)
        if hparams is not None and name in hparams:
            hparams[name] = value
