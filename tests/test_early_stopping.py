"""EarlyStopping: stops at the check a logged sequence predicts, also after a resume."""

import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer

SEQUENCE = [1.0, 0.9, 0.95, 0.92, 0.91, 0.5, 0.4, 0.3]  # patience 3: stops after 0.91


class Scores(jl.Callback):
    """``score`` for epoch e is SEQUENCE[e], put in callback_metrics after validation."""

    def on_validation_end(self, trainer, module):
        trainer.callback_metrics["score"] = SEQUENCE[trainer.current_epoch]


def _fit(root, max_epochs, ckpt_path=None):
    stopper = jl.EarlyStopping(monitor="score", patience=3)
    trainer = quiet_trainer(
        max_epochs=max_epochs,
        default_root_dir=root,
        enable_checkpointing=True,
        callbacks=[Scores(), stopper],
    )
    x, y = digits(32)
    trainer.fit(LitMLP(), loader(x, y, 16), loader(x, y, 16), ckpt_path=ckpt_path)
    return trainer, stopper


def test_stops_at_the_predicted_check_and_after_a_resume(tmp_path):
    # best 0.9 at epoch 1; 0.95, 0.92, 0.91 do not improve: stop after epoch 4
    trainer, stopper = _fit(tmp_path / "straight", 8)
    assert trainer.current_epoch == 5 and trainer.global_step == 10
    assert stopper.stopped_epoch == 4 and stopper.best_score == 0.9
    assert "did not improve" in stopper.stopping_reason_message

    _fit(tmp_path / "resumed", 3)  # checkpoint after epoch 2: one check without improvement
    resumed, again = _fit(tmp_path / "resumed", 8, ckpt_path="last")
    assert again.wait_count == 3 and again.best_score == 0.9
    assert resumed.current_epoch == 5 and resumed.global_step == 10


def test_thresholds_min_delta_and_non_finite_values():
    stopper = jl.EarlyStopping("m", mode="max", min_delta=0.1, patience=2)
    assert stopper.decide(0.5) == "" and stopper.decide(0.55) == ""  # +0.05: no improvement
    assert "did not improve" in stopper.decide(0.58)
    assert "not finite" in jl.EarlyStopping("m").decide(float("nan"))
    assert "Stopping threshold" in jl.EarlyStopping("m", stopping_threshold=0.1).decide(0.05)
    assert "Divergence threshold" in jl.EarlyStopping("m", divergence_threshold=5.0).decide(6.0)


def test_a_missing_metric_is_named_unless_not_strict(tmp_path):
    x, y = digits(32)
    strict = quiet_trainer(max_epochs=2, callbacks=[jl.EarlyStopping("val/nope")])
    with pytest.raises(RuntimeError, match="`val/nope` which is not available"):
        strict.fit(LitMLP(), loader(x, y, 16), loader(x, y, 16))
    lenient = quiet_trainer(max_epochs=2, callbacks=[jl.EarlyStopping("val/nope", strict=False)])
    lenient.fit(LitMLP(), loader(x, y, 16), loader(x, y, 16))
    assert lenient.current_epoch == 2
