"""The evaluation loop: validation (in fit and on its own), test, prediction and
the sanity check, with their hooks in Lightning's order."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxlightning import checks
from jaxlightning.cluster import distributed
from jaxlightning.data import Pipeline
from jaxlightning.loop.hooks import Hooks
from jaxlightning.metrics.logged import LogOptions
from jaxlightning.metrics.objects import Rows
from jaxlightning.module import JaxModule
from jaxlightning.programs.compiled import batch_args
from jaxlightning.programs.evaluation import EvalPrograms
from jaxlightning.progress import Progress
from jaxlightning.reporting.report import Report, report, results_table
from jaxlightning.reporting.reporter import Reporter
from jaxlightning.training import contract
from jaxlightning.training.step import Metrics, step_key

_STAGE_PREFIX = {"validation": "val", "test": "test"}


def eval_hook(module: JaxModule, stage: str) -> str:
    """The traced hook evaluating ``stage``: ``validation_step`` or ``test_step``
    where the module defines it, else ``eval_step``."""
    specific = {"validation": "validation_step", "test": "test_step"}[stage]
    return specific if contract.overrides(module, specific) else "eval_step"


@dataclasses.dataclass
class _HooksLogged:
    """What a loader's batch hooks logged on the host: each batch's step values
    for the loggers, and the loader's epoch values."""

    steps: list[Report]
    epoch: Report


def _with_hooks_steps(steps: list[Report], hooks_steps: list[Report]) -> list[Report]:
    """Each batch's step values: the traced step's and its hooks' together."""
    if not steps:
        return hooks_steps if any(r.logged for r in hooks_steps) else []
    for values, logged in zip(steps, hooks_steps, strict=True):
        values.update(logged)
    return steps


def as_list(loaders: Any) -> list[Any]:
    """One loader or a list/tuple of them, as a list (``None``: empty)."""
    if loaders is None:
        return []
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


class EvalLoop:
    """Runs evaluations and predictions over loaders from the pipeline.

    Args:
        pipeline: the batches of each loader.
        programs: the compiled evaluation steps and the variables they use.
        hooks: callback and module hooks.
        reporter: where an evaluation's values go.
        progress: ``num_eval_batches`` is set here.
        resolve_checkpoint: turns a ``ckpt_path`` (``"last"``, ``"best"``, a
            folder) into a checkpoint folder.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        programs: EvalPrograms,
        hooks: Hooks,
        reporter: Reporter,
        progress: Progress,
        resolve_checkpoint: Callable[[Any], str],
    ) -> None:
        self.pipeline = pipeline
        self.programs = programs
        self.held = programs.program.held  # throttles and fetches what evaluations return
        self.hooks = hooks
        self.reporter = reporter
        self.progress = progress
        self.resolve_checkpoint = resolve_checkpoint

    def run(
        self, stage: str, module: JaxModule, dataloaders: Any, ckpt_path: Any, verbose: bool
    ) -> list[dict[str, float]]:
        """A `validate` or `test` call: the evaluation, then the loggers finalized
        (quietly when the evaluation failed: its error is the one to see), and
        with ``verbose`` the results printed (process 0). With no batches to
        run (``limit_val_batches=0``, say), nothing: ``[]``."""
        if not self.has_batches(stage, dataloaders):
            return []
        try:
            results = self.evaluate(stage, module, dataloaders, ckpt_path)
        except BaseException:
            self.reporter.finalize(quiet=True)
            raise
        self.reporter.finalize()
        if verbose and distributed.is_rank_zero():
            print(results_table(results, {"validation": "Validate", "test": "Test"}[stage]))
        return results

    def validation_loaders(self, module: JaxModule, val: Any) -> Any:
        """``val`` as `fit` validates on it: ``None`` when validation is off
        (``limit_val_batches=0``, or, with a warning as in Lightning, a module
        without a validation step); refuses loaders it could read only once."""
        if val is None or not self.has_batches("validation", val):
            return None
        hook = eval_hook(module, "validation")
        if not contract.overrides(module, hook):
            warnings.warn(
                "You passed in a `val_dataloader` but have no `validation_step` (nor "
                "`eval_step`). Skipping val loop.",
                UserWarning,
                stacklevel=4,  # the user's fit line (here, Trainer._fit, Trainer.fit)
            )
            return None
        checks.module_hooks(module, hook)
        for loader in as_list(val):
            checks.reiterable(
                loader, "val_dataloaders", passes="in the sanity check and at every validation"
            )
        return val

    def has_batches(self, stage: str, dataloaders: Any) -> bool:
        """Whether an evaluation of ``stage`` would run any batch (a loader of
        unknown length may)."""
        return any(self.pipeline.eval_batches(stage, ld) != 0 for ld in as_list(dataloaders))

    def evaluate(
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

        Calls the stage's hooks in Lightning's order; the values go to the
        reporter, so they are in ``callback_metrics`` before
        ``on_<stage>_epoch_end`` runs. Without ``publish`` (the sanity check: at
        most ``limit`` batches per loader, inside `Reporter.discarding`) nothing
        is returned.
        """
        loaders = as_list(dataloaders)
        counts = [self.pipeline.eval_batches(stage, ld, limit) for ld in loaders]
        self.progress.num_eval_batches = None if None in counts else sum(counts)  # type: ignore[arg-type]
        with self.reporter.collecting_host_logs() as host_logged:
            self.hooks(f"on_{stage}_start", module)
            self.hooks(f"on_{stage}_epoch_start", module)
            prefix = self.reporter.prefix(_STAGE_PREFIX[stage])
            results, everything = [], Report()
            for i, loader in enumerate(loaders):
                suffix = f"/dataloader_idx_{i}" if len(loaders) > 1 else ""
                checkpoint = ckpt_path if i == 0 else None
                index = i if len(loaders) > 1 else None  # Lightning passes it with several
                metrics, options, per_batch, hooks_logged = self._evaluate_loader(
                    stage, module, loader, checkpoint, counts[i], index
                )
                # on_step=True values, each batch's own, fetched with the run's (one copy)
                steps = [report(prefix, options, m, "step", suffix) for m in per_batch]
                self.reporter.log_batches(_with_hooks_steps(steps, hooks_logged.steps), i)
                values = report(prefix, options, metrics, "epoch", suffix)
                values.update(hooks_logged.epoch)
                results.append(values.results)
                everything.update(values)
            with self.reporter.one_write():
                self.reporter.publish(everything)
                self.hooks(f"on_{stage}_epoch_end", module)
            self.hooks(f"on_{stage}_end", module)
        # What the module's hooks logged on the host belongs to every loader's results.
        return [{**r, **host_logged} for r in results] if publish else []

    def sanity_check(self, module: JaxModule, val_loaders: Any, steps: int) -> None:
        """``steps`` validation batches per loader (-1: all) before training,
        with their hooks (``trainer.sanity_checking`` meanwhile); their values
        reach ``callback_metrics`` but no logger, and are discarded afterwards."""
        if val_loaders is None or steps == 0:
            return
        self.hooks("on_sanity_check_start", module)
        self.progress.sanity_checking = True
        try:
            with self.reporter.discarding():
                limit = None if steps < 0 else steps
                self.evaluate("validation", module, val_loaders, limit=limit, publish=False)
        finally:
            self.progress.sanity_checking = False
        self.hooks("on_sanity_check_end", module)

    def _variables(self, module: JaxModule, first: Any, ckpt_path: Any) -> Any:
        checkpoint = None if ckpt_path is None else self.resolve_checkpoint(ckpt_path)
        swaps = [  # EMA evaluates with its average
            lambda state, swap=swap: swap(self.hooks.view, state)
            for _, swap in self.hooks.extensions.evaluation_variables
        ]
        variables, fresh = self.programs.variables(module, first, checkpoint, swaps)
        if fresh:
            warnings.warn(
                f"{type(module).__name__} has no trained variables (fit was not run and no "
                "ckpt_path given): evaluating the freshly initialised model",
                stacklevel=7,  # the user line calling validate or test
            )
        return variables

    def _evaluate_loader(
        self,
        stage: str,
        module: JaxModule,
        loader: Any,
        ckpt_path: Any,
        limit: int | None,
        dataloader_idx: int | None = None,
    ) -> tuple[Metrics, dict[str, LogOptions], list[Metrics], _HooksLogged]:
        """The run's metrics on the host, their options, each batch's own
        metrics of the names logged with ``on_step=True``, and what the batch
        hooks logged on the host."""
        hook = eval_hook(module, stage)
        suffix = "" if dataloader_idx is None else f"/dataloader_idx_{dataloader_idx}"
        logs = self.reporter.eval_loader_logs(suffix)
        hook_steps = []
        epoch = self.progress.current_epoch
        with self.pipeline.eval_pass(loader, f"the {stage} dataloader", limit, epoch) as batches:
            variables = self._variables(module, batches.first, ckpt_path)
            eval_step, acc, options = self.programs.eval_step(
                module, hook, batches.first, variables, dataloader_idx, self.hooks.view.stage
            )
            ranked = [n for n, o in options.items() if o.metric is not None and o.metric.collects]
            kept = ranked + [step_key(n) for n, o in options.items() if o.on_step]
            steps = []  # each step's rank-metric rows and own values (on device until the end)
            for batch_idx, batch in enumerate(batches):
                logs.batch(batch_idx, batch.host.real)
                self.hooks(f"on_{stage}_batch_start", module, batch_idx)
                out = eval_step(variables, acc, *batch_args(batch))
                acc = {n: m for n, m in out.items() if n in acc}
                if kept:
                    steps.append({n: out[n] for n in kept})
                self.held.throttle(out)
                self.hooks(f"on_{stage}_batch_end", module, batch_idx)
                hook_steps.append(logs.step_report())
            self.held.drain()
        metrics = self.held.fetch(acc)
        fetched = self.held.fetch(steps)
        for name in ranked:
            formula = options[name].metric.empty().formula  # type: ignore[union-attr]
            metrics[name] = Rows.concatenate([s[name] for s in fetched], formula)
        per_batch = [{n: s[step_key(n)] for n, o in options.items() if o.on_step} for s in fetched]
        per_batch = per_batch if kept != ranked else []
        hooks_logged = _HooksLogged(hook_steps, logs.epoch_end(completed=True))
        return {n: metrics[n] for n in options}, options, per_batch, hooks_logged

    # ------------------------------------------------------------- predict
    def predict(
        self, module: JaxModule, dataloaders: Any, ckpt_path: Any, concatenate: bool = False
    ) -> Any:
        """``predict_step`` outputs: a list with one entry per batch (its real
        rows), or with ``concatenate`` one row per dataset example; a list of
        those for a list of loaders."""
        if self.pipeline.schedule.limit_predict_batches is not None and jax.process_count() > 1:
            raise ValueError(
                "limit_predict_batches is not supported in a multi-process run (predict "
                "returns one row per dataset example); limit the dataset instead"
            )
        loaders = [self.pipeline.predict_loader(d) for d in as_list(dataloaders)]
        limits = [self.pipeline.eval_batches("predict", ld) for ld in loaders]
        self.progress.num_eval_batches = None if None in limits else sum(limits)  # type: ignore[arg-type]
        self.hooks("on_predict_start", module)
        self.hooks("on_predict_epoch_start", module)
        outputs = [
            self._predict_loader(module, ld, ckpt_path if i == 0 else None, limits[i])
            for i, ld in enumerate(loaders)
        ]
        if concatenate:
            outputs = [
                jax.tree.map(lambda *xs: np.concatenate(xs), *out) if out else out
                for out in outputs
            ]
        self.hooks("on_predict_epoch_end", module)
        self.hooks("on_predict_end", module)
        return outputs if isinstance(dataloaders, (list, tuple)) else outputs[0]

    def _predict_loader(self, module: JaxModule, loader: Any, ckpt_path: Any, limit: Any) -> Any:
        strategy = self.programs.strategy
        epoch = self.progress.current_epoch
        with self.pipeline.eval_pass(loader, "the predict dataloader", limit, epoch) as batches:
            variables = self._variables(module, batches.first, ckpt_path)
            predict_step = self.programs.predict_step(module)
            outputs = []
            for batch_idx, batch in enumerate(batches):
                self.hooks("on_predict_batch_start", module, batch_idx)
                out = predict_step(variables, batch.data, batch.mask)
                self.held.throttle(out)
                outputs.append((out, batch.host.real))
                self.hooks("on_predict_batch_end", module, batch_idx)
            self.held.drain()
        if jax.process_count() > 1:  # every process's rows, cut into the loader's batches
            whole = self._assemble(loader, [strategy.gather(o) for o, _ in outputs])
            rows, size = len(jax.tree.leaves(whole)[0]), loader.batch_size
            cut = range(0, rows, size)
            return [jax.tree.map(lambda x, i=i: x[i : i + size], whole) for i in cut]
        return [jax.tree.map(lambda x, n=n: x[:n], strategy.gather(o)) for o, n in outputs]

    def _assemble(self, loader: Any, gathered: list[Any]) -> Any:
        """Every process's rows, back in dataset order (multi-process runs)."""
        shares = self.pipeline.predict_shares(loader)
        processes, b = len(shares), loader.batch_size
        padded = jax.tree.leaves(gathered[0])[0].shape[0] // processes

        def place(*steps: np.ndarray) -> np.ndarray:
            out = np.empty((len(loader.dataset), *steps[0].shape[1:]), steps[0].dtype)
            for k, rows in enumerate(steps):
                for p, share in enumerate(shares):
                    idx = share[k * b : (k + 1) * b]
                    out[idx] = rows[p * padded : p * padded + len(idx)]
            return out

        return jax.tree.map(place, *gathered)
