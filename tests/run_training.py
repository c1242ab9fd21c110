"""A training run in its own process, for the checkpoint and fault tests.

    python -m tests.run_training --root DIR --max-steps N [--ckpt-path last]
        [--devices 8] [--out params.npz] [--slow-after K] [--kill-during-save-at K]
        [--every-n-train-steps K] [--dirpath DIR]

Trains the dropout MLP on a shuffled digits DataLoader, validating each epoch,
and writes the final train state to ``--out``.
"""

import argparse
import glob
import os
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--ckpt-path")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--out")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--every-n-train-steps", type=int)
    p.add_argument("--dirpath", help="ModelCheckpoint's folder")
    p.add_argument(
        "--fill-disk-after", type=int, help="once step K's checkpoint is complete, fill the disk"
    )
    p.add_argument("--slow-after", type=int, help="sleep after each step from this step on")
    p.add_argument("--kill-during-save-at", type=int)
    args = p.parse_args()

    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import signal
    import time

    import jax
    import numpy as np

    import jaxlightning as jl
    from tests.helpers import LitMLP, digits, loader

    class Faults(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            step = trainer.global_step
            if args.slow_after is not None and step >= args.slow_after:
                if step == args.slow_after:
                    print("READY", flush=True)
                time.sleep(0.05)
            if args.fill_disk_after is not None and step == args.fill_disk_after + 1:
                fill_disk(trainer.checkpoint_callback.dirpath, args.fill_disk_after)
            if step == args.kill_during_save_at:
                path = trainer.checkpoint_callback.save(trainer, module)
                print(f"SAVING {path}", flush=True)
                # Killed once orbax has started writing (its temporary folder
                # exists): orbax may create it on its own thread, a little later.
                deadline = time.monotonic() + 10
                while not glob.glob(f"{path}.orbax-checkpoint-tmp*"):
                    if time.monotonic() > deadline:
                        break
                os.kill(os.getpid(), signal.SIGKILL)

    def fill_disk(folder, step):
        """Waits for checkpoint ``step`` to be complete, then fills its file system."""
        from jaxlightning.io.checkpoint import complete_checkpoints

        deadline = time.monotonic() + 60
        while not any(p.endswith(f"/{step}") for p in complete_checkpoints(folder)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {step} never completed")
            time.sleep(0.05)
        try:
            with open(os.path.join(folder, "..", "filler"), "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * 4096)
        except OSError:  # no space left: what this fault is
            pass
        print(f"DISK FULL after step {step}", flush=True)

    x, y = digits(200)  # 7 batches of 32 per epoch, the last of 8 rows
    checkpoint = jl.ModelCheckpoint(args.dirpath, every_n_train_steps=args.every_n_train_steps)
    trainer = jl.Trainer(
        stage_prefix=True,  # train/acc and val/acc apart (TensorBoard tags checked)
        log_loss=True,  # train/loss among them
        max_steps=args.max_steps,
        devices=args.devices,
        default_root_dir=args.root,
        log_every_n_steps=3,
        enable_progress_bar=False,
        callbacks=[checkpoint, Faults()],
        seed=7,
    )
    model = LitMLP(hidden=args.hidden, lr=3e-3, dropout=args.dropout)
    trainer.fit(
        model,
        loader(x, y, 32, shuffle=True),
        loader(*digits(45, offset=1000), 16),
        ckpt_path=args.ckpt_path,
    )
    if args.out:
        state = jax.device_get(trainer.state)
        leaves = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
        np.savez(args.out, **{jax.tree_util.keystr(k): v for k, v in leaves})
    print(f"DONE step={trainer.global_step} log_dir={trainer.log_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
