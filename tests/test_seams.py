"""The fit loop's parts one seam at a time, each built without a Trainer and
without compiling a train step: the data's groups and epochs, where a group
ends and how big it may be, the callbacks' extensions, the state points and
their guards, a rollback against a fake editor, and the held state's edits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import jax
import numpy as np
import pytest

import jaxlightning as jl
from jaxlightning.callbacks.base import Extensions, needs_each_step
from jaxlightning.callbacks.rollback import RollbackGuard
from jaxlightning.data.fit_data import FitData, rebatched
from jaxlightning.loop.groups import AUTO_GROUP, Groups
from jaxlightning.loop.hooks import Hooks
from jaxlightning.loop.state_points import StatePoints
from jaxlightning.loop.stop import StopPolicy
from jaxlightning.metrics.logged import Extreme
from jaxlightning.programs.held_state import HeldState
from jaxlightning.progress import Progress
from jaxlightning.schedule import Schedule
from jaxlightning.training.scales import PlateauScaleState, RollbackScaleState
from jaxlightning.training.state import TrainState
from jaxlightning.training.step import LOSS_MAX, TrainMetrics

# ---------------------------------------------------------------- FitData


def test_groups_cut_where_the_rule_says_numbered_from_skip_asked_lazily():
    log = []

    def batches():
        for b in (10, 11, 12, 13, 14, 15):
            log.append(("pull", b))
            yield b

    limit = [2]

    def ends(batch_idx, size):
        log.append(("ask", batch_idx, size))
        return size >= limit[0]

    for group in FitData.groups(batches(), 3, ends):
        log.append(("got", group))
        limit[0] = 3  # what the rule answers next depends on the group handled

    assert log == [
        ("pull", 10),
        ("ask", 3, 1),
        ("pull", 11),
        ("ask", 4, 2),
        ("got", [(3, 10), (4, 11)]),
        ("pull", 12),
        ("ask", 5, 1),
        ("pull", 13),
        ("ask", 6, 2),
        ("pull", 14),
        ("ask", 7, 3),
        ("got", [(5, 12), (6, 13), (7, 14)]),
        ("pull", 15),
        ("ask", 8, 1),
        ("got", [(8, 15)]),  # the batches ran out: a short group
    ]


class FakePipeline:
    """Records what `FitData` asks of the pipeline; an epoch is a list of names."""

    def __init__(self, per_epoch):
        self.per_epoch = per_epoch
        self.calls = []

    def train_batches_per_epoch(self, loader):
        self.calls.append(("per_epoch", loader))
        return self.per_epoch

    def train_path(self, loader):
        self.calls.append(("path", loader))
        return None  # the host path

    def train_epoch(self, loader, epoch, skip, resident, state=None):
        self.calls.append(("epoch", loader, epoch, skip, resident))
        return [f"e{epoch}b{i}" for i in range(skip, self.per_epoch or 0)]


def test_epoch_hands_back_the_opened_first_epoch_from_its_start_and_later_ones_from_0():
    loader = SimpleNamespace(batch_size=3, dataset=range(36))  # 12 batches of 3
    pipeline = FakePipeline(12)
    data = FitData(pipeline, loader)
    assert pipeline.calls == [("per_epoch", loader)] and data.trains
    # a checkpoint after 2 batches of 6 rows: 12 rows, batch 4 of this run's 3
    meta = {"progress": {"batch": 2, "batching": {"processes": 1, "batch_size": 6}}}
    assert data.resume_at(meta) == (4, None)
    assert data.skip == 4

    opened = data.open(1)
    # where the batches come from is decided at the first pass, then kept
    assert pipeline.calls[-2:] == [("path", loader), ("epoch", loader, 1, 4, None)]
    assert opened[0] == "e1b4"
    batches, start = data.epoch(1)
    assert batches is opened and start == 4
    assert len(pipeline.calls) == 3  # not opened again

    batches, start = data.epoch(2)
    assert start == 0 and batches[0] == "e2b0"
    assert pipeline.calls[-1] == ("epoch", loader, 2, 0, None)
    batches, start = data.epoch(1)  # the opened one was handed out: from 0 now
    assert start == 0 and pipeline.calls[-1] == ("epoch", loader, 1, 0, None)
    assert [c for c in pipeline.calls if c[0] == "path"] == [("path", loader)]

    assert data.batches_left(4, None) == 8
    assert data.batches_left(4, 3) == 3
    unsized = FitData(FakePipeline(None), loader)
    assert unsized.batches_left(0, 7) == 7 and unsized.batches_left(0, None) is None
    assert not FitData(FakePipeline(0), loader).trains


def test_rebatched_carries_the_position_in_examples():
    saved = {"progress": {"batching": {"processes": 2, "batch_size": 4}}}  # 8 rows a batch
    kw = dict(processes=1, batch_size=4, num_examples=100)
    assert rebatched(saved, 3, **kw) == 6  # 24 rows consumed
    assert rebatched(saved, 0, **kw) == 0
    assert rebatched(None, 3, **kw) == 3  # no record of the batching: as it was
    assert rebatched(saved, 13, **kw) == 25  # 104 >= 100 rows: the epoch's end, ceil(100/4)
    with pytest.raises(ValueError, match="does not divide 8"):
        rebatched(saved, 1, processes=1, batch_size=3, num_examples=100)


# ---------------------------------------------------------------- Groups


class Wants:
    """A `StatePoints` stand-in: the updates a subscriber wants the state of."""

    def __init__(self, steps=()):
        self.steps = set(steps)

    def wants_state_at(self, step):
        return step in self.steps


def _cut(n, *, size, left=None, skip=0, log_every=1000, wants=(), accumulate=1, **kw):
    """The groups (batch indices) a fit cuts ``n`` batches in, from ``skip``,
    counting each group's batches after it as the loop does."""
    progress = Progress(accumulate=accumulate, global_step=kw.get("global_step", 0))
    progress.num_training_batches = n - skip if left is None else left
    schedule = kw.get("schedule") or Schedule()
    stop = StopPolicy(schedule, progress)
    stop.should_stop = kw.get("stopping", False)  # asked for, held back by min_steps
    groups = Groups(
        size,
        groupable=True,
        hooks=Hooks([], None),
        points=Wants(wants),
        progress=progress,
        schedule=schedule,
        stop=stop,
        log_every_n_steps=log_every,
    )
    validates, epoch_batches = kw.get("validates", False), kw.get("epoch_batches")

    def ends(batch_idx, group_size):
        done = batch_idx + 1
        return groups.ends(0, done, done - skip, group_size, epoch_batches, validates)

    cut = []
    for group in FitData.groups(range(skip, n), skip, ends):
        cut.append([i for i, _ in group])
        for _ in group:
            progress.count_micro_batch()
    return cut


def test_groups_end_at_the_size_a_report_a_wanted_update_the_epochs_end_and_a_stop():
    assert _cut(8, size=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # the epoch runs 7 batches (max_steps, say) of more: its last ends a group
    assert _cut(12, size=4, left=7) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10], [11]]
    # resumed at batch 3 with 5 to run: the 5th since the start ends one
    assert _cut(12, size=4, left=5, skip=3) == [[3, 4, 5, 6], [7], [8, 9, 10, 11]]
    # reports every 3 updates, from update 1: at updates 3, 6, 9
    assert _cut(9, size=8, log_every=3, global_step=1) == [[0, 1], [2, 3, 4], [5, 6, 7], [8]]
    assert _cut(10, size=8, wants={2, 7}) == [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9]]
    # a stop held back until its exact step: one step per group meanwhile
    assert _cut(3, size=8, stopping=True) == [[0], [1], [2]]


def test_groups_under_accumulation_end_only_where_an_update_completes():
    # every update reported: a group ends after each pair of micro-batches
    assert _cut(6, size=8, accumulate=2, log_every=1) == [[0, 1], [2, 3], [4, 5]]
    # updates 1 and 3 wanted: after micro-batches 2 and 6
    assert _cut(10, size=8, accumulate=2, wants={1, 3}) == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]


def test_groups_end_at_validations_counted_in_batches_only_with_validation_loaders():
    every4 = Schedule(val_check_interval=4)
    kw = dict(size=8, schedule=every4, epoch_batches=10)
    assert _cut(10, validates=True, **kw) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert _cut(10, validates=False, **kw) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]]


class PlainModule(jl.JaxModule):
    pass


class OwnBatchStart(jl.JaxModule):
    def on_train_batch_start(self, batch_idx):
        return None


class EveryBatch(jl.Callback):
    def on_train_batch_end(self, trainer, module, batch_idx):
        pass


def _settling(requested, callbacks, groupable=True, schedule=None):
    hooks, progress, schedule = Hooks(list(callbacks), None), Progress(), schedule or Schedule()
    return Groups(
        requested,
        groupable=groupable,
        hooks=hooks,
        points=StatePoints(hooks),
        progress=progress,
        schedule=schedule,
        stop=StopPolicy(schedule, progress),
        log_every_n_steps=50,
    )


AUTO = "steps_per_execution='auto'"
DURATION = Schedule.from_trainer_args(
    limits={}, overfit_batches=None, fast_dev_run=0, val_check_interval={"minutes": 5}
)


@pytest.mark.parametrize(
    "requested, callbacks, module, groupable, schedule, size, why",
    [
        ("auto", [jl.TQDMProgressBar(), jl.Callback()], PlainModule, True, None, 8, AUTO),
        (
            "auto",
            [jl.TQDMProgressBar(), EveryBatch()],
            PlainModule,
            True,
            None,
            1,
            f"{AUTO}: EveryBatch act(s) after each step",
        ),
        (
            "auto",
            [],
            OwnBatchStart,
            True,
            None,
            1,
            f"{AUTO}: OwnBatchStart defines on_train_batch_start",
        ),
        (
            "auto",
            [],
            PlainModule,
            False,
            None,
            1,
            f"{AUTO}: this strategy runs one step per dispatch",
        ),
        (
            "auto",
            [],
            PlainModule,
            True,
            DURATION,
            1,
            f"{AUTO}: val_check_interval is a duration, checked after each step",
        ),
        (3, [EveryBatch()], OwnBatchStart, False, None, 3, "steps_per_execution=3"),
    ],
    ids=["auto", "callback-each-step", "module-hook", "not-groupable", "duration", "int"],
)
def test_settle_chooses_the_group_size_and_says_why(
    requested, callbacks, module, groupable, schedule, size, why
):
    groups = _settling(requested, callbacks, groupable, schedule)
    assert groups.settle(module()) == size == groups.size
    assert groups.why == why
    assert AUTO_GROUP == 8


# ---------------------------------------------------------------- Extensions


class Optimizing(jl.Callback):
    def transform_optimizer(self, tx):
        return tx

    def wants_state_at(self, step):
        return step == 4


class Declared(jl.Callback):
    """No batch hook, yet it says it needs each step."""

    def needs_each_step(self):
        return True

    def wants_state_at(self, step):
        return step == 9


class Evaluating(jl.Callback):
    def evaluation_variables(self, trainer, state):
        return state

    def on_stop_signal(self, trainer, module):
        return "saved"


def test_extensions_collect_optional_methods_in_order_and_who_needs_each_step():
    opt, each, bar, declared, ev = (
        Optimizing(),
        EveryBatch(),
        jl.TQDMProgressBar(),
        Declared(),
        Evaluating(),
    )
    ext = Extensions.of([opt, each, bar, declared, ev])
    assert ext.transform_optimizer == ((opt, opt.transform_optimizer),)
    assert ext.wants_state_at == ((opt, opt.wants_state_at), (declared, declared.wants_state_at))
    assert [wants(9) for _, wants in ext.wants_state_at] == [False, True]  # bound to their own
    assert ext.evaluation_variables == ((ev, ev.evaluation_variables),)
    assert ext.on_stop_signal == ((ev, ev.on_stop_signal),)
    assert ext.state_guard == ()
    # the bar overrides on_train_batch_end but declares it needs no step of its own
    assert ext.each_step == (each, declared)
    assert [needs_each_step(c) for c in (opt, each, bar, declared, ev)] == [
        False,
        True,
        False,
        True,
        False,
    ]


def test_hooks_extensions_are_collected_again_only_when_the_callbacks_change():
    callbacks = [Optimizing()]
    hooks = Hooks(callbacks, None)
    first = hooks.extensions
    assert hooks.extensions is first
    policy = jl.Rollback()
    callbacks.append(policy)
    second = hooks.extensions
    assert second is not first
    assert [c for c, _ in second.state_guard] == [policy]
    assert [c for c, _ in second.transform_optimizer] == [callbacks[0], policy]
    assert hooks.extensions is second
    callbacks[0] = Declared()  # same length, another callback
    assert hooks.extensions.each_step == (callbacks[0],)


# ---------------------------------------------------------------- StatePoints


class FakeGuard:
    def __init__(self, name, log):
        self.name, self.log, self.back = name, log, False

    def mark_good(self, reported_loss=None):
        self.log.append((self.name, "good", reported_loss))

    def checked(self):
        self.log.append((self.name, "checked"))
        return False

    def rolled_back(self, acc):
        self.log.append((self.name, "rolled_back", acc))
        return self.back


class Guarding(jl.Callback):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def state_guard(self, trainer):
        self.log.append((self.name, "built", trainer))
        return FakeGuard(self.name, self.log)


class Saving(jl.Callback):
    def __init__(self, path, log):
        self.path, self.log = path, log

    def on_stop_signal(self, trainer, module):
        self.log.append(("save", self.path, trainer, module))
        return self.path


def test_state_points_build_guards_consult_them_and_collect_stop_signal_saves():
    log, view, module = [], object(), object()
    callbacks = [
        Guarding("a", log),
        Saving("p1", log),
        jl.Callback(),
        Guarding("b", log),
        Saving(None, log),
        Saving("p3", log),
        Optimizing(),
    ]
    points = StatePoints(Hooks(callbacks, view))
    assert points.guards == [] and log == []
    assert points.wants_state_at(4) and not points.wants_state_at(5)

    points.start()
    assert [e for e in log if e[1] == "built"] == [("a", "built", view), ("b", "built", view)]
    assert sorted(e for e in log if e[1] == "good") == [("a", "good", None), ("b", "good", None)]
    assert [g.name for g in points.guards] == ["a", "b"]

    log.clear()
    points.before_use()
    assert log == [("a", "checked"), ("b", "checked")]

    acc = object()
    log.clear()
    assert points.rolled_back(acc) is False
    assert log == [("a", "rolled_back", acc), ("b", "rolled_back", acc)]
    points.guards[1].back = True
    assert points.rolled_back(acc) is True

    log.clear()
    points.reported(0.25)
    assert log == [("a", "good", 0.25), ("b", "good", 0.25)]

    log.clear()
    assert points.stop_signal(module) == ["p1", "p3"]
    assert log == [  # the state checked first, then each save
        ("a", "checked"),
        ("b", "checked"),
        ("save", "p1", view, module),
        ("save", None, view, module),
        ("save", "p3", view, module),
    ]


# ---------------------------------------------------------------- RollbackGuard


class FakeEdit:
    """`StateEdits` on plain values: the state is an int, a point a copy of it
    and the step; the data reads on from where it is (a go-back keeps `batch`)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.state, self.trained, self.batch = 0, 0, 0
        self.acc = None
        self.went_back, self.located, self.set, self.published = [], [], [], []

    def save_point(self):
        return (self.state, self.trainer.global_step)

    def go_back(self, point):
        self.went_back.append(point)
        self.state, self.trainer.global_step = point
        return self.trainer.current_epoch, self.batch

    def batches_trained(self):
        return self.trained

    def fetch_metrics(self):
        return self.acc

    def locate(self, batch_number):
        self.located.append(batch_number)
        return batch_number - 1, batch_number + 10

    def publish(self, name, value):
        self.published.append((name, value))

    def set_optimizer_state(self, kind, **values):
        self.set.append((kind, values))


class FakeTrainer:
    def __init__(self):
        self.global_step, self.current_epoch = 0, 2
        self.edit = FakeEdit(self)

    def train(self, batches, state):
        """``batches`` updates trained to ``state``."""
        self.global_step += batches
        self.edit.trained += batches
        self.edit.batch += batches
        self.edit.state = state


def _acc(loss_max=1.0, first_nonfinite=0, seen=1):
    metric = Extreme(value=np.asarray(loss_max, np.float32), count=np.asarray(seen, np.int32))
    return SimpleNamespace(
        metrics={LOSS_MAX: metric}, first_nonfinite=np.asarray(first_nonfinite, np.int32)
    )


def test_rollback_guard_keeps_good_states_and_goes_back_from_bad_ones():
    policy = jl.Rollback(spike_factor=None, max_retries=2)
    trainer = FakeTrainer()
    edit = trainer.edit
    guard = policy.state_guard(trainer)
    assert isinstance(guard, RollbackGuard)
    guard.mark_good()  # training starts: state 0 at step 0

    trainer.train(4, state=40)
    assert guard.rolled_back(_acc(1.5)) is False
    assert edit.state == 40 and edit.went_back == [] and edit.published == []
    guard.mark_good(1.5)  # a report: state 40 at step 4 is good
    assert policy.history == [1.5]

    trainer.train(3, state=-1)
    assert guard.rolled_back(_acc(1.0, first_nonfinite=6)) is True
    assert edit.state == 40 and trainer.global_step == 4 and edit.located == [6]
    assert policy.events == [
        {
            "step": 7,
            "to_step": 4,
            "reason": "a non-finite loss at step 5 (epoch 2, batch 16)",
            "batches_skipped": 3,
            "epoch": 2,
            "batch": 7,
            "lr_scale": 1.0,
        }
    ]
    assert edit.published == [("train/rollbacks", 1.0)]

    trainer.train(2, state=-2)  # straight into another bad loss: the largest one NaN
    edit.acc = _acc(np.nan)
    assert guard.checked() is True
    assert edit.state == 40 and trainer.global_step == 4
    assert policy.events[-1]["reason"] == "a non-finite loss (nan)"
    assert policy.events[-1]["batches_skipped"] == 2 and policy.events[-1]["step"] == 6
    assert edit.published[-1] == ("train/rollbacks", 2.0)

    guard.mark_good()  # nothing trained since the rollback: the streak goes on
    trainer.train(1, state=-3)
    with pytest.raises(jl.NonFiniteLossError, match="after 2 rollbacks in a row to step 4"):
        guard.rolled_back(_acc(np.inf))
    assert edit.set == []  # lr_factor=1: the rate is never touched


def test_rollback_streak_ends_at_a_good_check_after_training():
    policy = jl.Rollback(spike_factor=None, max_retries=1)
    trainer = FakeTrainer()
    guard = policy.state_guard(trainer)
    guard.mark_good()
    trainer.train(2, state=-1)
    assert guard.rolled_back(_acc(np.nan))
    trainer.train(2, state=20)
    trainer.edit.acc = _acc(1.0)
    assert guard.checked() is False  # good: kept, and the streak ends
    assert trainer.edit.state == 20 and policy.retries == 0
    trainer.train(1, state=-1)
    assert guard.rolled_back(_acc(np.nan))  # a first retry again, allowed
    assert trainer.edit.state == 20 and trainer.global_step == 2
    trainer.train(1, state=-1)
    with pytest.raises(jl.NonFiniteLossError):
        guard.rolled_back(_acc(np.nan))


def test_rollback_on_a_spike_over_the_windowed_median_lowers_the_rate():
    policy = jl.Rollback(spike_factor=3.0, window=3, min_history=2, lr_factor=0.5)
    trainer = FakeTrainer()
    edit = trainer.edit
    guard = policy.state_guard(trainer)
    guard.mark_good()
    trainer.train(1, state=1)
    guard.mark_good(10.0)
    trainer.train(1, state=-1)
    assert not guard.rolled_back(_acc(100.0))  # one report of history: too few to judge
    for state, loss in enumerate((10.0, 1.0, 1.0), start=2):
        trainer.train(1, state=state)
        guard.mark_good(loss)
    assert policy.history == [10.0, 1.0, 1.0]  # the window's last 3: median 1
    trainer.train(1, state=-1)
    assert not guard.rolled_back(_acc(2.9))
    assert not guard.rolled_back(_acc(np.inf, seen=0))  # no real row: nothing to judge
    assert edit.went_back == []
    # 3.5 > 3 x 1 (over the whole history's median, 5.5, it would not be)
    assert guard.rolled_back(_acc(3.5))
    assert edit.state == 4 and policy.events[-1]["reason"] == "a loss spike (3.5 > 3 x median 1)"
    assert edit.set == [(RollbackScaleState, {"scale": 0.5})]
    assert policy.lr_scale == 0.5 and policy.events[-1]["lr_scale"] == 0.5
    trainer.train(1, state=-1)
    assert guard.rolled_back(_acc(5.0))
    assert edit.set[-1] == (RollbackScaleState, {"scale": 0.25})


# ---------------------------------------------------------------- HeldState


class Missing(NamedTuple):
    scale: np.ndarray


def _held(progress=None, first_nonfinite=0, stop=True):
    strategy = jl.ShardMapStrategy()
    strategy.setup(jax.devices()[:2])
    held = HeldState(strategy, progress or Progress(), stop_on_nonfinite_loss=stop)
    opt_state = (
        RollbackScaleState(scale=np.ones((), np.float32)),
        {
            "inner": RollbackScaleState(scale=np.ones((3,), np.float16)),
            "plateau": PlateauScaleState(scale=np.ones((), np.float32)),
        },
        np.full((2,), 7.0, np.float32),
    )
    state = TrainState(
        step=np.asarray(5, np.int32),
        params={"w": np.arange(4, dtype=np.float32)},
        opt_state=opt_state,
        model_state={},
        rng=np.zeros((2,), np.uint32),
    )
    acc = TrainMetrics(metrics={}, epoch={}, first_nonfinite=np.asarray(first_nonfinite, np.int32))
    held.hold(state, acc, acc)
    return held


def _scales(held):
    rollback, nested, other = held.live_state().opt_state
    return (
        np.asarray(rollback.scale).tolist(),
        np.asarray(nested["inner"].scale).tolist(),
        np.asarray(nested["plateau"].scale).tolist(),
        np.asarray(other).tolist(),
    )


def _donate(held):
    """What a train step does to the state it reads: its buffers are gone."""
    jax.tree.map(lambda x: x.delete(), held.live_state())


def test_held_state_writes_the_fields_of_one_kind_and_snapshots_restore():
    held = _held()
    before = held.live_state().opt_state
    snap = held.snapshot()
    held.set_optimizer_state(RollbackScaleState, scale=0.25)
    assert _scales(held) == (0.25, [0.25, 0.25, 0.25], 1.0, [7.0, 7.0])
    rollback, nested, _ = held.live_state().opt_state
    assert nested["inner"].scale.dtype == np.float16 and nested["inner"].scale.shape == (3,)
    assert rollback.scale.sharding == before[0].scale.sharding
    assert np.asarray(held.live_state().params["w"]).tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="holds no Missing"):
        held.set_optimizer_state(Missing, scale=0.5)

    _donate(held)  # the snapshot is a copy that outlives the state it was taken of
    held.restore(snap)
    assert _scales(held) == (1.0, [1.0, 1.0, 1.0], 1.0, [7.0, 7.0])
    held.set_optimizer_state(PlateauScaleState, scale=0.5)
    assert _scales(held) == (1.0, [1.0, 1.0, 1.0], 0.5, [7.0, 7.0])
    _donate(held)
    held.restore(snap)  # the restored state was a copy too: the snapshot still holds
    assert _scales(held) == (1.0, [1.0, 1.0, 1.0], 1.0, [7.0, 7.0])
    assert np.asarray(held.live_state().params["w"]).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_held_state_names_the_step_and_batch_of_a_non_finite_loss():
    progress = Progress(accumulate=2, current_epoch=1, epoch_offset=2)
    # the device's batch 7: update (7 - 1) // 2 + 1 = 4, batch 7 - 1 - 2 = 4 of the epoch
    with pytest.raises(jl.NonFiniteLossError, match=r"at step 4 \(epoch 1, batch 4\)"):
        _held(progress, first_nonfinite=7).fetch_metrics()
    assert int(_held(progress, first_nonfinite=7, stop=False).fetch_metrics().first_nonfinite) == 7


def test_hooks_extensions_see_a_new_callback_that_replaced_a_freed_one():
    class Plain(jl.Callback):
        pass

    class Wanting(jl.Callback):
        def wants_state_at(self, step):
            return True

    for _ in range(20):  # a freed callback's id is often reused at once
        callbacks = [Plain()]
        hooks = Hooks(callbacks, None)
        assert hooks.extensions.wants_state_at == ()
        callbacks.pop()  # freed at once (no cycle): its id is free for the next object
        callbacks.append(Wanting())
        assert [type(c) for c, _ in hooks.extensions.wants_state_at] == [Wanting]


@pytest.mark.parametrize(
    "callback, needs",
    [
        (jl.LearningRateMonitor(logging_interval="epoch"), False),
        (jl.LearningRateMonitor(logging_interval="step"), True),
        (jl.LearningRateMonitor(), True),  # None: the rates at each logging interval
        (jl.callbacks.Timer(duration={"minutes": 1}, interval="epoch"), False),
        (jl.callbacks.Timer(duration={"minutes": 1}), True),
        (jl.callbacks.Timer(), False),  # no limit: nothing to check
        (jl.ModelCheckpoint(every_n_train_steps=5), False),  # ends a group there instead
        (jl.ModelCheckpoint(train_time_interval=60), True),
    ],
    ids=[
        "lr-epoch",
        "lr-step",
        "lr-none",
        "timer-epoch",
        "timer-step",
        "timer-off",
        "ckpt-steps",
        "ckpt-time",
    ],
)
def test_the_built_in_callbacks_say_whether_they_act_after_each_step(callback, needs):
    assert needs_each_step(callback) is needs
