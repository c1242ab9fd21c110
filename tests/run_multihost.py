"""One training run for the multi-process tests; run it plainly or under the launcher.

    python -m jaxlightning.launch --nprocs 2 --devices-per-proc 4 \\
        tests/run_multihost.py --root DIR --out result.npz [--sleep-per-step S] [--strategy fsdp]
        [--nnx] [--steps-per-execution K] [--log-every N]

Global batch 64 (each process's DataLoader holds its share: 64 / processes),
one epoch over 200 digits, validation on 45 (not a multiple of 8 devices).
Process 0 writes the final params, validation metrics and predictions.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--nnx", action="store_true", help="the same MLP written in Flax NNX")
    p.add_argument("--steps-per-execution", type=int, default=1)
    p.add_argument("--log-every", type=int, default=2)
    args = p.parse_args(argv)

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxlightning as jl
    from tests.helpers import LitMLP, digits, init_mlp, loader, nnx_mlp_module

    class Slow(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            if args.sleep_per_step:
                print(f"step {trainer.global_step}", flush=True)
                time.sleep(args.sleep_per_step)

    trainer = jl.Trainer(
        max_epochs=args.epochs,
        default_root_dir=args.root,
        log_every_n_steps=args.log_every,
        enable_progress_bar=False,
        callbacks=[Slow()],
        strategy=args.strategy,
        steps_per_execution=args.steps_per_execution,
    )
    per_process = 64 // jax.process_count()
    x, y = digits(200)
    vx, vy = digits(45, offset=1000)
    if args.nnx:
        model = nnx_mlp_module(init_mlp(), lr=1e-2)
    else:
        model = LitMLP(lr=1e-2, init_variables=init_mlp())
    trainer.fit(model, loader(x, y, per_process), loader(vx, vy, 16))
    (val,) = trainer.validate(model, loader(vx, vy, 16))
    pred = trainer.predict(model, loader(vx, vy, 16))
    # Under FSDP each process holds only its shards: gathered by every process.
    params = multihost_utils.process_allgather(trainer.state.params, tiled=True)
    if args.out and jax.process_index() == 0:
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        np.savez(
            args.out,
            val_acc=val["val/acc"],
            val_loss=val["val/loss"],
            logits=pred["logits"],
            processes=jax.process_count(),
            devices=len(jax.devices()),
            **{jax.tree_util.keystr(k): v for k, v in leaves},
        )
    print(f"DONE rank={jax.process_index()} step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
