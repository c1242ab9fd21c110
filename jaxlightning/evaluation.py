"""Validation, test and prediction: the Trainer's evaluation loops."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from jaxlightning.checkpoint import restore_variables
from jaxlightning.data import Batches, DeviceBatch
from jaxlightning.datamodule import loaders as datamodule_loaders
from jaxlightning.metrics import LogOptions
from jaxlightning.module import JaxModule
from jaxlightning.reporting import Report, report
from jaxlightning.sampling import (
    BatchSlice,
    EpochSampler,
    epoch_loader,
    in_dataset_order,
    whole_batches,
)
from jaxlightning.step import Metrics, build_eval_step, build_predict_step, zero_eval_metrics

_STAGE_PREFIX = {"validation": "val", "test": "test"}


def eval_hook(module: JaxModule, stage: str) -> str:
    """The traced hook evaluating ``stage``: ``validation_step`` or ``test_step``
    where the module defines it, else ``eval_step``."""
    specific = {"validation": "validation_step", "test": "test_step"}[stage]
    return specific if type(module)._overrides(specific) else "eval_step"


def shard_shapes(tree: Any, rows: int) -> Any:
    """Abstract shapes of one device's shard of a host batch, in the dtypes JAX
    will give it (int64 labels become int32 unless x64 is enabled)."""

    def shard(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, *x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype))

    return jax.tree.map(shard, tree)


class EvaluationMixin:
    """`validate`, `test` and `predict` of `jaxlightning.Trainer`.

    Part of the Trainer (it uses the Trainer's strategy, callbacks and state),
    kept in its own file so that the training loop reads on its own.
    """

    def _eval_variables(self, module: JaxModule, first: DeviceBatch, ckpt_path: Any) -> Any:
        if ckpt_path is not None:
            path = self._resolve_ckpt_path(ckpt_path)
            expected = self._init_state(module, None, first, abstract=True)
            module.variables = restore_variables(path, expected)
            if self._fit_module is module:  # its variables no longer are the fit's state
                self._fit_module = None
            return self._place_variables(module, first, module.variables)
        if self._state is not None and self._fit_module is module:
            variables = self._state.variables
            for callback in self.callbacks:  # EMA evaluates with its average
                swap = getattr(callback, "evaluation_variables", None)
                if swap is not None:
                    variables = swap(self, variables)
            return variables
        if module.variables is None:
            warnings.warn(
                f"{type(module).__name__} has no trained variables (fit was not run and no "
                "ckpt_path given): evaluating the freshly initialised model",
                stacklevel=4,
            )
        variables = self._init_state(module, None, first)
        if self.strategy.shards_state:  # built in place
            return variables
        return self.strategy.replicate(variables)

    def _evaluate(
        self,
        stage: str,
        module: JaxModule,
        dataloaders: Any,
        ckpt_path: Any = None,
        *,
        limit: int | None = None,
        publish: bool = True,
    ) -> list[dict[str, float]]:
        """Evaluates every loader; returns their ``val/...`` (or ``test/...``) values.

        With ``publish``, calls the stage's callback hooks and hands the values
        out (`_publish`), so they are in ``callback_metrics`` before
        ``on_<stage>_end`` runs. Without it (the sanity check), only runs the
        batches (at most ``limit`` per loader) and returns nothing.
        """
        loaders = list(dataloaders) if isinstance(dataloaders, (list, tuple)) else [dataloaders]
        counts = [self.schedule.batches(stage, self._num_batches_plain(ld)) for ld in loaders]
        if limit is not None:  # the sanity check's
            counts = [limit if n is None else min(n, limit) for n in counts]
        self.num_eval_batches = None if None in counts else sum(counts)  # type: ignore[arg-type]
        if publish:
            self._call(f"on_{stage}_start", module)
            self._call(f"on_{stage}_epoch_start", module)
        prefix = _STAGE_PREFIX[stage]
        results, everything = [], Report()
        for i, loader in enumerate(loaders):
            suffix = f"/dataloader_idx_{i}" if len(loaders) > 1 else ""
            checkpoint = ckpt_path if i == 0 else None
            metrics, options = self._evaluate_loader(
                stage, module, loader, checkpoint, counts[i], publish
            )
            values = report(prefix, options, metrics, "epoch", suffix)
            results.append(values.values)
            everything.update(values)
        if not publish:
            return []
        self._publish(everything)
        self._call(f"on_{stage}_epoch_end", module)
        self._call(f"on_{stage}_end", module)
        return results

    def _evaluate_loader(
        self,
        stage: str,
        module: JaxModule,
        loader: Any,
        ckpt_path: Any,
        limit: int | None,
        publish: bool,
    ) -> tuple[Metrics, dict[str, LogOptions]]:
        hook = eval_hook(module, stage)
        with self._eval_batches(loader, f"the {stage} dataloader", limit) as batches:
            first = batches.first
            variables = self._eval_variables(module, first, ckpt_path)
            rows = first.host.mask.shape[0] // self.strategy.num_local_shards
            example = shard_shapes(first.host.data, rows)
            shapes = (jax.tree.structure(example), tuple(jax.tree.leaves(example)))
            key = ("eval", hook, module, shapes)
            if key not in self._eval_fns:
                compiled = self.strategy.compile(
                    build_eval_step(module, hook, self.step_options.precision),
                    sharded_args=(False, False, True, True),
                    sharded_out=False,
                )
                local = jax.eval_shape(self.strategy.unreplicate, variables)
                zeros, options = zero_eval_metrics(module, hook, local, example)
                self._eval_fns[key] = (compiled, self.strategy.replicate(zeros), options)
            eval_step, acc, options = self._eval_fns[key]
            for batch_idx, batch in enumerate(batches):
                acc = eval_step(variables, acc, batch.data, batch.mask)
                self._throttle(acc)
                if publish:
                    self._call(f"on_{stage}_batch_end", module, batch_idx)
            self._drain()
        return self._fetch(acc), options

    def _eval_batches(self, loader: Any, name: str, limit: int | None = None) -> Batches:
        """An evaluation loader's batches (at most ``limit``): in a multi-process
        run, this process's share."""
        if jax.process_count() == 1:
            source = whole_batches(loader)
            if limit is not None:
                source = BatchSlice(source, 0, limit)
            return self._batches(source, name)
        ordered = epoch_loader(
            loader,
            epoch=0,
            seed=self.seed,
            own=self.use_distributed_sampler,
            rank=jax.process_index(),
            replicas=jax.process_count(),
        )
        total = self._common_total(loader, ordered)
        if limit is not None:
            total = limit if total is None else min(total, limit)
        return self._batches(ordered, name, total=total)

    @staticmethod
    def _num_batches_plain(loader: Any) -> int | None:
        try:
            return len(loader)
        except TypeError:
            return None

    def validate(
        self,
        module: JaxModule,
        dataloaders: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: Any = None,
    ) -> list[dict[str, float]]:
        """Evaluates ``module`` (its ``validation_step``, else ``eval_step``);
        returns ``[{"val/...": v}]``, one dict per loader.

        Uses the module's trained variables, or those of ``ckpt_path``
        (``"last"``, ``"best"`` or a checkpoint folder), which it then keeps.
        ``datamodule=`` takes the loaders from its ``val_dataloader()``.
        """
        return self._run_eval_stage("validation", module, dataloaders, datamodule, ckpt_path)

    def test(
        self,
        module: JaxModule,
        dataloaders: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: Any = None,
    ) -> list[dict[str, float]]:
        """Like `validate`, with ``test_step`` (else ``eval_step``) and ``test/`` names."""
        return self._run_eval_stage("test", module, dataloaders, datamodule, ckpt_path)

    def _run_eval_stage(
        self, stage: str, module: JaxModule, dataloaders: Any, datamodule: Any, ckpt_path: Any
    ) -> list[dict[str, float]]:
        with self._stage("validate" if stage == "validation" else stage, module, datamodule):
            dataloaders = self._stage_loaders(stage, dataloaders, datamodule)
            self._check_module(module, eval_hook(module, stage))
            _ = self.log_dir  # fixes the run directory on every process at once
            try:
                results = self._evaluate(stage, module, dataloaders, ckpt_path)
            except BaseException:
                self._finalize_loggers(quiet=True)
                raise
            self._finalize_loggers()
            return results

    @staticmethod
    def _stage_loaders(stage: str, dataloaders: Any, datamodule: Any) -> Any:
        if datamodule is None:
            if dataloaders is None:
                raise TypeError(f"{stage} needs dataloaders (or datamodule=...)")
            return dataloaders
        if dataloaders is not None:
            raise ValueError(f"pass either dataloaders or datamodule= to {stage}, not both")
        return datamodule_loaders(datamodule, stage, required=True)

    def predict(
        self,
        module: JaxModule,
        dataloaders: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: Any = None,
    ) -> Any:
        """Runs ``predict_step`` over ``dataloaders`` (with ``ckpt_path``'s variables).

        Returns:
            The outputs concatenated over batches, padding removed: one row per
            dataset example, in order (numpy arrays, same pytree structure as
            ``predict_step``'s output). A list of those for a list of loaders.
        """
        with self._stage("predict", module, datamodule):
            dataloaders = self._stage_loaders("predict", dataloaders, datamodule)
            self._check_module(module, "predict_step")
            if isinstance(dataloaders, (list, tuple)):
                return [
                    self._predict_loader(module, d, ckpt_path if i == 0 else None)
                    for i, d in enumerate(dataloaders)
                ]
            return self._predict_loader(module, dataloaders, ckpt_path)

    def _predict_loader(self, module: JaxModule, loader: Any, ckpt_path: Any) -> Any:
        loader = in_dataset_order(loader)
        limit = self.schedule.batches("predict", self._num_batches_plain(loader))
        if self.schedule.limit_predict_batches is not None and jax.process_count() > 1:
            raise ValueError(
                "limit_predict_batches is not supported in a multi-process run (predict "
                "returns one row per dataset example); limit the dataset instead"
            )
        self.num_eval_batches = limit
        self._call("on_predict_start", module)
        with self._eval_batches(loader, "the predict dataloader", limit) as batches:
            variables = self._eval_variables(module, batches.first, ckpt_path)
            key = ("predict", module)
            if key not in self._eval_fns:
                self._eval_fns[key] = self.strategy.compile(
                    build_predict_step(module, self.step_options.precision),
                    sharded_args=(False, True, True),
                    sharded_out=True,
                )
            predict_step = self._eval_fns[key]
            outputs = []
            for batch_idx, batch in enumerate(batches):
                out = predict_step(variables, batch.data, batch.mask)
                self._throttle(out)
                outputs.append((out, batch.host.real))
                self._call("on_predict_batch_end", module, batch_idx)
            self._drain()
        self._call("on_predict_end", module)
        if jax.process_count() > 1:
            return self._assemble_predictions(loader, [o for o, _ in outputs])
        rows = [jax.tree.map(lambda x, n=n: x[:n], self.strategy.gather(o)) for o, n in outputs]
        return jax.tree.map(lambda *xs: np.concatenate(xs), *rows)

    def _assemble_predictions(self, loader: Any, outputs: list[Any]) -> Any:
        """Every process's rows, back in dataset order (multi-process runs)."""
        if not self.use_distributed_sampler:
            raise ValueError(
                "predict in a multi-process run needs use_distributed_sampler=True, so the "
                "Trainer knows which process holds which example"
            )
        processes, b = jax.process_count(), loader.batch_size
        sampler = EpochSampler(
            len(loader.dataset), shuffle=False, seed=self.seed, replicas=processes
        )
        shares = [sampler.share(p) for p in range(processes)]
        gathered = [self.strategy.gather(o) for o in outputs]
        padded = jax.tree.leaves(gathered[0])[0].shape[0] // processes

        def place(*steps: np.ndarray) -> np.ndarray:
            out = np.empty((len(loader.dataset), *steps[0].shape[1:]), steps[0].dtype)
            for k, rows in enumerate(steps):
                for p, share in enumerate(shares):
                    idx = share[k * b : (k + 1) * b]
                    out[idx] = rows[p * padded : p * padded + len(idx)]
            return out

        return jax.tree.map(place, *gathered)
