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
