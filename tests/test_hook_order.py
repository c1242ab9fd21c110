"""The exact order of host-side hooks, translated from Lightning's call-list tests.

Each test here translates one test of Lightning's
``tests/tests_pytorch/models/test_hooks.py`` (as of Lightning commit
7f0c3436cd3f6ad3753125672024fc415cbcb414): a callback and a module record every
hook call, and the record must equal Lightning's expected list, keeping
Lightning's order of every hook jaxlightning has (or should have).

Documented deviations from Lightning (entries of Lightning's lists left out here):

- The module's traced hooks, ``setup(rng, batch)`` (it builds the variables; it is
  not Lightning's ``setup(stage)``), ``loss``,
  ``eval_step``/``validation_step``/``test_step`` and ``predict_step``, are traced
  once under ``jit``: they are not per-batch events and are not recorded.
- No ``forward``, ``backward``, ``zero_grad``, ``optimizer_zero_grad``,
  ``optimizer_step``, ``clip_gradients``, ``lr_scheduler_step``,
  ``on_before_backward``/``on_after_backward``/``on_before_optimizer_step``/
  ``on_before_zero_grad`` (the update is one compiled step), no batch transfer
  hooks, no ``train()``/``eval()``/``on_*_model_eval``/``on_*_model_train``
  (flax modules have no mode), no ``configure_model``, ``configure_callbacks``,
  ``prepare_data``, ``*_dataloader`` (loaders are passed to the Trainer call) and
  no module ``setup(stage)``/``teardown(stage)``.
- Callback hooks get ``(trainer, module, ...)``; batch hooks get ``batch_idx``
  only (no batch, no outputs); so do the module's batch hooks here.
- ``Callback.state_dict`` is not recorded (Lightning lists it right before
  ``Callback.on_save_checkpoint``). ``Callback.load_state_dict`` is recorded, to
  pin Lightning's resume order: the module's ``on_load_checkpoint``, then the
  callbacks' ``on_load_checkpoint``, then the callbacks' ``load_state_dict``.
- Checkpoint hooks are recorded with the checkpoint's ``global_step`` (Lightning
  compares the whole checkpoint dict; jaxlightning's record differs).
"""

import difflib
from typing import Any

import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, init_mlp, loader, quiet_trainer

STAGES = ("train", "validation", "test", "predict")

CALLBACK_HOOKS = (
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    *(f"on_{s}_batch_{when}" for s in STAGES for when in ("start", "end")),
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_exception",
)

MODULE_HOOKS = (
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    *(f"on_{s}_batch_{when}" for s in STAGES for when in ("start", "end")),
    "on_save_checkpoint",
    "on_load_checkpoint",
)


def _details(name: str, args: tuple) -> dict[str, Any]:
    """What a call records besides its name: the stage, the batch index, the
    checkpoint's step, or the exception's type."""
    if name in ("setup", "teardown"):
        return {"stage": args[0]}
    if "_batch_" in name:
        return {"batch_idx": args[0]}
    if name in ("on_save_checkpoint", "on_load_checkpoint"):
        return {"global_step": args[0]["progress"]["global_step"]}
    if name == "on_exception":
        return {"exception": type(args[0]).__name__}
    return {}


class HookedCallback(jl.Callback):
    """Records ``{"name": "Callback.<hook>", ...}`` for every callback hook."""

    def __init__(self, called: list[dict[str, Any]]) -> None:
        self.called = called
        self.modules: list[Any] = []  # the module argument of every call

    def state_dict(self) -> dict[str, Any]:
        return {"foo": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.called.append({"name": "Callback.load_state_dict", "state": state})


def _callback_hook(name: str):
    def hook(self, trainer, module, *args):
        self.modules.append(module)
        self.called.append({"name": f"Callback.{name}", **_details(name, args)})

    hook.__name__ = hook.__qualname__ = name
    return hook


for _name in CALLBACK_HOOKS:
    setattr(HookedCallback, _name, _callback_hook(_name))


class HookedModule(LitMLP):
    """`LitMLP` recording ``{"name": "<hook>", ...}`` for every host-side hook."""

    def __init__(self, called: list[dict[str, Any]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.called = called

    def configure_optimizers(self):  # on the host, once per fit: Lightning lists it
        self.called.append({"name": "configure_optimizers"})
        return super().configure_optimizers()


def _module_hook(name: str):
    if "_batch_" in name:

        def hook(self, batch_idx):
            self.called.append({"name": name, "batch_idx": batch_idx})

    elif name in ("on_save_checkpoint", "on_load_checkpoint"):

        def hook(self, checkpoint):
            self.called.append({"name": name, **_details(name, (checkpoint,))})

    else:

        def hook(self):
            self.called.append({"name": name})

    hook.__name__ = hook.__qualname__ = name
    return hook


for _name in MODULE_HOOKS:
    setattr(HookedModule, _name, _module_hook(_name))


# ------------------------------------------------------------ expected lists
def cb(name: str, **details: Any) -> dict[str, Any]:
    return {"name": f"Callback.{name}", **details}


def mod(name: str, **details: Any) -> list[dict[str, Any]]:
    return [{"name": name, **details}]


def both(name: str, **details: Any) -> list[dict[str, Any]]:
    """The callbacks' hook, then the module's (Lightning's order)."""
    return [cb(name, **details), *mod(name, **details)]


def train_batches(start: int, stop: int) -> list[dict[str, Any]]:
    """Lightning's `HookedModel._auto_train_batch`, host-side hooks only."""
    out = []
    for i in range(start, stop):
        out += [
            *both("on_train_batch_start", batch_idx=i),
            *both("on_train_batch_end", batch_idx=i),
        ]
    return out


def eval_batches(fn: str, batches: int) -> list[dict[str, Any]]:
    """Lightning's `HookedModel._eval_batch` (and `_predict_batch`)."""
    out = []
    for i in range(batches):
        out += [
            *both(f"on_{fn}_batch_start", batch_idx=i),
            *both(f"on_{fn}_batch_end", batch_idx=i),
        ]
    return out


def eval_epoch(fn: str, batches: int) -> list[dict[str, Any]]:
    """Lightning's `HookedModel._eval_epoch`."""
    return [
        *both(f"on_{fn}_epoch_start"),
        *eval_batches(fn, batches),
        *both(f"on_{fn}_epoch_end"),
    ]


def evaluation(fn: str, batches: int) -> list[dict[str, Any]]:
    return [*both(f"on_{fn}_start"), *eval_epoch(fn, batches), *both(f"on_{fn}_end")]


def fit_end(step: int) -> list[dict[str, Any]]:
    """The end of a fit's last epoch on. Lightning's ``FitLoop.on_advance_end``
    calls ``on_train_epoch_end`` on the callbacks other than `ModelCheckpoint` and
    `EarlyStopping`, then on the module, then on those monitoring callbacks: the
    default `ModelCheckpoint` (after `HookedCallback`) saves after the module's
    hook, so that it can monitor what that hook logs. Then the fit ends."""
    return [
        *both("on_train_epoch_end"),
        # `ModelCheckpoint` saves here (Lightning also lists `Callback.state_dict`)
        *both("on_save_checkpoint", global_step=step),
        *both("on_train_end"),
        *both("on_fit_end"),
        cb("teardown", stage="fit"),
    ]


def _line(call: dict[str, Any]) -> str:
    details = ", ".join(f"{k}={v}" for k, v in call.items() if k != "name")
    return f"{call['name']}({details})"


def assert_calls(called: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """``called == expected``; on failure, the first difference and a diff of the hooks."""
    if called == expected:
        return
    got, want = [_line(c) for c in called], [_line(c) for c in expected]
    first = next(
        (i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
        min(len(got), len(want)),
    )
    diff = "\n".join(
        difflib.unified_diff(want, got, "lightning order", "jaxlightning calls", lineterm="", n=2)
    )
    raise AssertionError(
        f"hook calls differ from Lightning's from call {first}:\n"
        f"  expected: {want[first] if first < len(want) else '(end)'}\n"
        f"  called:   {got[first] if first < len(got) else '(end)'}\n{diff}"
    )


def _check_recorder(called: list[dict[str, Any]], callback: HookedCallback, module: Any) -> None:
    """The recorders work: hooks that jaxlightning surely calls are recorded, and
    callbacks got the module the Trainer ran."""
    names = [c["name"] for c in called]
    assert "Callback.setup" in names and "Callback.teardown" in names, names
    assert callback.modules and all(m is module for m in callback.modules)


def _data(n_batches: int, batch_size: int = 16, offset: int = 0):
    return loader(*digits(n_batches * batch_size, offset), batch_size)


def _trainer(tmp_path, callbacks, **kwargs) -> jl.Trainer:
    return quiet_trainer(
        default_root_dir=tmp_path, enable_checkpointing=True, callbacks=callbacks, **kwargs
    )


# ------------------------------------------------------------------- tests
# Lightning: tests/tests_pytorch/models/test_hooks.py::test_trainer_model_hook_system_fit
# (kwargs={"devices": 1}, automatic_optimization=True; override_on_validation_model_train
# has no counterpart: flax modules have no train/eval mode).
def test_trainer_model_hook_system_fit(tmp_path):
    called: list[dict[str, Any]] = []
    model = HookedModule(called)
    callback = HookedCallback(called)
    train_batches_, val_batches = 2, 2
    trainer = _trainer(
        tmp_path,
        [callback],
        max_epochs=1,
        limit_train_batches=train_batches_,
        limit_val_batches=val_batches,
    )
    trainer.fit(model, _data(4), _data(4, offset=64))
    _check_recorder(called, callback, model)
    assert trainer.global_step == train_batches_
    expected = [
        cb("setup", stage="fit"),
        {"name": "configure_optimizers"},
        *both("on_fit_start"),
        cb("on_sanity_check_start"),
        *evaluation("validation", val_batches),
        cb("on_sanity_check_end"),
        *both("on_train_start"),
        *both("on_train_epoch_start"),
        *train_batches(0, train_batches_),
        *evaluation("validation", val_batches),
        *fit_end(step=train_batches_),
    ]
    assert_calls(called, expected)


# Lightning: tests/tests_pytorch/models/test_hooks.py
#   ::test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs
# (no validation: no val loader instead of limit_val_batches=0).
def test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs(tmp_path):
    # initial training to get a checkpoint
    first = _trainer(tmp_path, [HookedCallback([])], max_epochs=1, limit_train_batches=2)
    first.fit(HookedModule([]), _data(4))
    best_model_path = first.checkpoint_callback.best_model_path
    assert best_model_path

    called: list[dict[str, Any]] = []
    callback = HookedCallback(called)
    trainer = _trainer(tmp_path, [callback], max_epochs=2, limit_train_batches=2)
    # resume from checkpoint with HookedModule
    model = HookedModule(called)
    trainer.fit(model, _data(4), ckpt_path=best_model_path)
    _check_recorder(called, callback, model)
    assert trainer.global_step == 4 and trainer.current_epoch == 2
    expected = [
        cb("setup", stage="fit"),
        # Lightning's resume order: the module's hook, the callbacks', then their state
        *mod("on_load_checkpoint", global_step=2),
        cb("on_load_checkpoint", global_step=2),
        {"name": "Callback.load_state_dict", "state": {"foo": True}},
        {"name": "configure_optimizers"},  # after the states, as Lightning
        *both("on_fit_start"),
        *both("on_train_start"),
        *both("on_train_epoch_start"),
        *train_batches(0, 2),
        *fit_end(step=4),
    ]
    assert_calls(called, expected)


# Lightning: tests/tests_pytorch/models/test_hooks.py
#   ::test_trainer_model_hook_system_fit_no_val_and_resume_max_steps
# (Lightning's epoch has 64 batches; 4 here: the resumed run still stops mid-epoch).
def test_trainer_model_hook_system_fit_no_val_and_resume_max_steps(tmp_path):
    # initial training to get a checkpoint
    first = _trainer(tmp_path, [HookedCallback([])], max_steps=1)
    first.fit(HookedModule([]), _data(4))
    best_model_path = first.checkpoint_callback.best_model_path
    assert best_model_path

    # resume from checkpoint with HookedModule
    called: list[dict[str, Any]] = []
    model = HookedModule(called)
    callback = HookedCallback(called)
    # already performed 1 step, resume and do 2 more
    train_batches_ = 2
    steps_after_reload = 1 + train_batches_
    trainer = _trainer(tmp_path, [callback], max_steps=steps_after_reload)
    trainer.fit(model, _data(4), ckpt_path=best_model_path)
    _check_recorder(called, callback, model)
    assert trainer.global_step == steps_after_reload
    expected = [
        cb("setup", stage="fit"),
        *mod("on_load_checkpoint", global_step=1),
        cb("on_load_checkpoint", global_step=1),
        {"name": "Callback.load_state_dict", "state": {"foo": True}},
        {"name": "configure_optimizers"},  # after the states, as Lightning
        *both("on_fit_start"),
        *both("on_train_start"),
        # resumed mid-epoch: no on_train_epoch_start; the epoch cut short by
        # max_steps still ends with on_train_epoch_end, where the checkpoint is saved
        *train_batches(1, steps_after_reload),
        *fit_end(step=steps_after_reload),
    ]
    assert_calls(called, expected)


# Lightning: tests/tests_pytorch/models/test_hooks.py::test_trainer_model_hook_system_eval
# (override_on_x_model_train has no counterpart: flax modules have no train/eval mode).
@pytest.mark.parametrize("batches", [0, 2])
@pytest.mark.parametrize(("verb", "noun"), [("validate", "validation"), ("test", "test")])
def test_trainer_model_hook_system_eval(tmp_path, batches, verb, noun):
    called: list[dict[str, Any]] = []
    model = HookedModule(called)
    model.variables = init_mlp()  # Lightning evaluates the untrained model
    callback = HookedCallback(called)
    trainer = _trainer(
        tmp_path,
        [callback],
        max_epochs=1,
        limit_val_batches=batches,
        limit_test_batches=batches,
    )
    getattr(trainer, verb)(model, _data(4))
    _check_recorder(called, callback, model)
    expected = [
        cb("setup", stage=verb),
        *(evaluation(noun, batches) if batches else []),
        cb("teardown", stage=verb),
    ]
    assert_calls(called, expected)


# Lightning: tests/tests_pytorch/models/test_hooks.py::test_trainer_model_hook_system_predict
def test_trainer_model_hook_system_predict(tmp_path):
    called: list[dict[str, Any]] = []
    model = HookedModule(called)
    model.variables = init_mlp()
    callback = HookedCallback(called)
    batches = 2
    trainer = _trainer(tmp_path, [callback], limit_predict_batches=batches)
    out = trainer.predict(model, _data(4), concatenate=True)
    _check_recorder(called, callback, model)
    assert out["logits"].shape == (batches * 16, 10)
    expected = [
        cb("setup", stage="predict"),
        *both("on_predict_start"),
        *both("on_predict_epoch_start"),
        *eval_batches("predict", batches),
        *both("on_predict_epoch_end"),
        *both("on_predict_end"),
        cb("teardown", stage="predict"),
    ]
    assert_calls(called, expected)
