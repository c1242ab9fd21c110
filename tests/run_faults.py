"""One fit that must end cleanly, in its own process, for the start-up fault tests.

    python -m tests.run_faults CASE ROOT

A fit that fails must raise (exit status 1 with its message), never abort the
process while a compile or prefetch thread still runs; a fit with nothing left
to do must say so and exit 0. Prints ``STEP`` after every training step.
"""

import os
import sys


def main() -> None:
    case, root = sys.argv[1], sys.argv[2]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import optax

    import jaxlightning as jl
    from tests.helpers import LitMLP, digits, loader

    class Faulty(LitMLP):
        def loss(self, variables, batch, rngs):
            x, y = batch
            logits = self.net.apply(variables, x)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            if case == "log-shape":
                self.log("logits", logits)
            if case == "log-keyword":
                self.log("acc", 1.0, bogus=True)
            if case == "loss-dict":
                return {"loss": per_example.mean(), "acc": per_example}  # extra: refused
            return per_example

        def eval_step(self, variables, batch):
            if case == "eval-bug":
                raise KeyError("eval_step looked up a missing key")
            super().eval_step(variables, batch)

    class Steps(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            print("STEP", flush=True)

    def trainer():
        return jl.Trainer(
            stage_prefix=True,  # train/acc and val/acc apart (TensorBoard tags checked)
            max_epochs=1,
            default_root_dir=root,
            enable_progress_bar=False,
            callbacks=[Steps()],
        )

    train, val = loader(*digits(64), 16), loader(*digits(32, 1000), 16)
    first = trainer()
    first.fit(Faulty(), train, val)
    if case == "second-fit":
        first.fit(Faulty(), train, val)
    if case == "finished-resume":
        trainer().fit(Faulty(), train, val, ckpt_path="last")


if __name__ == "__main__":
    main()
