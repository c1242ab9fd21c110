"""One training run for the multi-process tests; run it plainly or under the launcher.

    python -m jaxlightning.launch --nprocs 2 --devices-per-proc 4 \\
        tests/run_multihost.py --root DIR --out result.npz [--sleep-per-step S] [--strategy fsdp]
        [--nnx] [--steps-per-execution K] [--log-every N]
        [--batch B] [--shuffle] [--save-every N] [--ckpt-path P] [--record FILE]
        [--grain | --grain-global [--fits straight,resumed]]

Global batch 64 (each process's DataLoader holds its share: 64 / processes),
one epoch over 200 digits, validation on 45 (not a multiple of 8 devices).
Process 0 writes the final params, validation metrics and predictions.
``--record`` reads the training digits through a Dataset that notes each index
it is asked for; each process writes its list to ``FILE.rank<r>.json``.
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
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--save-every", type=int, help="also checkpoint every N steps")
    p.add_argument("--ckpt-dir", help="where --save-every's checkpoints go (default: the run's)")
    p.add_argument("--ckpt-path")
    p.add_argument("--record")
    p.add_argument(
        "--grain",
        action="store_true",
        help="train on a grain DataLoader sharded by process, checkpoint at step 2 and "
        "resume from it in a second fit; writes both runs' params",
    )
    p.add_argument(
        "--grain-global",
        action="store_true",
        help="train on a grain DataLoader cutting one global order by process, in the "
        "fits --fits names: straight (checkpoints every 2 steps), resumed (from --ckpt-path); "
        "writes their params, and with --record each fit's records read",
    )
    p.add_argument("--fits", type=lambda s: s.split(","), default=["straight"])
    args = p.parse_args(argv)

    import json

    import jax
    import numpy as np
    import torch
    from jax.experimental import multihost_utils

    import jaxlightning as jl
    from tests.helpers import LitMLP, digits, init_mlp, loader, nnx_mlp_module

    class Recording(torch.utils.data.Dataset):
        def __init__(self, x, y):
            self.x, self.y, self.seen = x, y, []

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            self.seen.append(int(i))
            return self.x[i], self.y[i]

    class Slow(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            if args.sleep_per_step:
                print(f"step {trainer.global_step}", flush=True)
                time.sleep(args.sleep_per_step)

    def make_trainer(root):
        return jl.Trainer(
            stage_prefix=True,  # train/acc and val/acc apart (TensorBoard tags checked)
            log_loss=True,  # train/loss among them
            max_epochs=args.epochs,
            default_root_dir=root,
            log_every_n_steps=args.log_every,
            enable_progress_bar=False,
            callbacks=[jl.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)],
            use_distributed_sampler=False,
        )

    if args.grain or args.grain_global:
        import grain

        class Source:
            def __init__(self):
                self.seen = []

            def __len__(self):
                return 200

            def __getitem__(self, i):
                self.seen.append(int(i))
                return x[i], y[i]

            def __repr__(self):
                return "Source(200)"

        def grain_loader(source):
            by_process = grain.sharding.ShardByJaxProcess(drop_remainder=True)
            batch = grain.transforms.Batch(batch_size=args.batch // jax.process_count())
            if args.grain_global:  # one order, cut by process: resumable on another count
                sampler = grain.samplers.IndexSampler(
                    num_records=200, shuffle=True, seed=0, num_epochs=1
                )
                return grain.DataLoader(
                    data_source=source,
                    sampler=sampler,
                    operations=[batch],
                    shard_options=by_process,
                    read_options=grain.ReadOptions(num_threads=0),  # records asked in order
                )
            sampler = grain.samplers.IndexSampler(
                num_records=200, shuffle=True, seed=0, num_epochs=1, shard_options=by_process
            )
            return grain.DataLoader(data_source=source, sampler=sampler, operations=[batch])

        x, y = digits(200)
        if args.grain_global:
            fits = [(name, args.ckpt_path if name == "resumed" else None) for name in args.fits]
        else:
            fits = [("straight", None), ("resumed", "straight")]
        runs = {}
        for name, ckpt in fits:
            trainer = make_trainer(os.path.join(args.root, name))
            if ckpt == "straight":
                ckpt = os.path.join(args.root, ckpt, "lightning_logs/version_0/checkpoints/2")
            model = LitMLP(lr=1e-2, init_variables=init_mlp())
            source = Source()
            trainer.fit(model, grain_loader(source), ckpt_path=ckpt)
            runs[name] = multihost_utils.process_allgather(trainer.state.params, tiled=True)
            if args.record:
                with open(f"{args.record}.{name}.rank{jax.process_index()}.json", "w") as f:
                    json.dump({"seen": source.seen, "global_step": trainer.global_step}, f)
        if jax.process_index() == 0:
            np.savez(
                args.out,
                **{
                    f"{name}{jax.tree_util.keystr(k)}": v
                    for name, params in runs.items()
                    for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
                },
            )
        print(f"DONE rank={jax.process_index()} step={trainer.global_step}", flush=True)
        return

    trainer = jl.Trainer(
        stage_prefix=True,  # train/acc and val/acc apart (TensorBoard tags checked)
        log_loss=True,  # train/loss among them
        max_epochs=args.epochs,
        default_root_dir=args.root,
        log_every_n_steps=args.log_every,
        enable_progress_bar=False,
        callbacks=[Slow()]
        + (
            [jl.ModelCheckpoint(args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1)]
            if args.save_every
            else []
        ),
        strategy=args.strategy,
        steps_per_execution=args.steps_per_execution,
    )
    per_process = args.batch // jax.process_count()
    x, y = digits(200)
    train = loader(x, y, per_process, shuffle=args.shuffle)
    if args.record:
        data = Recording(x, y)
        train = torch.utils.data.DataLoader(data, batch_size=per_process, shuffle=args.shuffle)
    vx, vy = digits(45, offset=1000)
    if args.nnx:
        model = nnx_mlp_module(init_mlp(), lr=1e-2)
    else:
        model = LitMLP(lr=1e-2, init_variables=init_mlp())
    trainer.fit(model, train, loader(vx, vy, 16), ckpt_path=args.ckpt_path)
    if args.record:
        with open(f"{args.record}.rank{jax.process_index()}.json", "w") as f:
            json.dump({"seen": data.seen, "global_step": trainer.global_step}, f)
    (val,) = trainer.validate(model, loader(vx, vy, 16))
    pred = trainer.predict(model, loader(vx, vy, 16), concatenate=True)
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
