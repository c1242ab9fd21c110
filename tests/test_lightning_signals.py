"""Lightning's signal-connector tests, translated
(``tests/tests_pytorch/trainer/connectors/test_signal_connector.py``).

Here SIGTERM during `fit` saves a resume point at the next step and exits with
``SystemExit(128 + 15)`` (Lightning raises its ``SIGTERMException``); what the
translated tests check is that a user's own handler still runs and that the
Trainer says it received the signal.
"""

from __future__ import annotations

import os
import signal

import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer


@pytest.fixture
def sigterm_default():
    yield
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_sigterm_handler_can_be_added(sigterm_default):
    """test_sigterm_handler_can_be_added: the user's handler is composed, not replaced."""
    ran = []

    def handler(*_):
        ran.append(True)

    signal.signal(signal.SIGTERM, handler)

    class SendsSigterm(LitMLP):
        def on_train_batch_end(self, batch_idx):
            if batch_idx == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = quiet_trainer(max_epochs=1)
    assert not trainer.received_sigterm and not ran
    with pytest.raises(SystemExit) as exit_info:
        trainer.fit(SendsSigterm(), loader(*digits(64), 16))
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert trainer.received_sigterm
    assert ran == [True]
    assert trainer.global_step == 2  # stopped at the step after the signal
    assert signal.getsignal(signal.SIGTERM) is handler  # the user's handler is back


def test_signal_handlers_restored_after_fit(sigterm_default):
    """test_signal_handlers_restored_in_teardown: SIG_DFL before, SIG_DFL after."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    quiet_trainer(max_steps=1).fit(LitMLP(), loader(*digits(16), 16))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


class _Interrupts(jl.Callback):
    def on_train_batch_start(self, trainer, module, batch_idx):
        raise KeyboardInterrupt


class _RaisesOnTestStart(jl.Callback):
    def on_test_start(self, trainer, module):
        raise ValueError("misconfigured")


class _Records(jl.Callback):
    def __init__(self):
        self.exception = None
        self.teardown_sigint = None

    def on_exception(self, trainer, module, exception):
        self.exception = exception

    def teardown(self, trainer, module, stage):
        self.teardown_sigint = signal.getsignal(signal.SIGINT)


def test_on_exception_hook_and_interrupted_flag():
    """tests/tests_pytorch/trainer/test_trainer.py::test_on_exception_hook and
    test_states.py::test_interrupt_state_on_keyboard_interrupt: a KeyboardInterrupt
    in fit calls on_exception, then exits with status 1; trainer.interrupted says so.
    Another Ctrl-C during the shutdown is ignored; the handler before returns after."""
    before = signal.getsignal(signal.SIGINT)
    records = _Records()
    x, y = digits(128)
    trainer = quiet_trainer(max_epochs=1, callbacks=[_Interrupts(), _RaisesOnTestStart(), records])
    assert not trainer.interrupted and records.exception is None
    with pytest.raises(SystemExit) as exit_info:
        trainer.fit(LitMLP(), loader(x, y, 32))
    assert exit_info.value.code == 1
    assert trainer.interrupted
    assert isinstance(records.exception, KeyboardInterrupt)
    assert records.teardown_sigint == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(ValueError, match="misconfigured"):
        trainer.test(LitMLP(), loader(x, y, 32))
    assert trainer.interrupted
    assert isinstance(records.exception, ValueError)
    trainer.validate(LitMLP(), loader(x, y, 32))  # a call that succeeds clears the flag
    assert not trainer.interrupted
