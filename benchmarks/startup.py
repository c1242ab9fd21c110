"""One short job in a fresh process (arms 4 and 8): prints one JSON line.

    python -m benchmarks.startup --framework jl|lightning --root DIR [--cache DIR]
        [--host] [--workers N [--context fork|forkserver|spawn] [--per-example]] [--epochs E]

Process start and imports are excluded: the clock starts when the job builds
its trainer. Reports the time to the first finished training step, the whole
``fit`` (1 epoch, validation included) and, for jaxlightning, the number of XLA
compilations and persistent-cache hits; with ``--epochs`` above 1, each
epoch's time. ``--workers`` gives both loaders that many DataLoader workers
started by ``--context`` (default: the Trainer's choice); ``--per-example``
reads rows through a per-example ``__getitem__`` (`common.RowDataset`).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["jl", "lightning"], required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--cache")
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--host", action="store_true", help="data_on_device=False")
    p.add_argument("--features", type=int, default=784)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--context")
    p.add_argument("--per-example", action="store_true")
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

    from benchmarks import common

    x, y = common.data(args.samples, args.features)
    vx, vy = common.data(2000, args.features, seed=1)
    kw = {"num_workers": args.workers, "multiprocessing_context": args.context}
    train = common.loader(x, y, 128, per_example=args.per_example, **kw)
    val = common.loader(vx, vy, 128, per_example=args.per_example, **kw)
    first: list[float] = []
    if args.framework == "lightning":
        import lightning  # noqa: F401  (imports are process start, not the job)

        from benchmarks import lightning_arm

        start = time.perf_counter()
        lightning_arm.fit(train, 1, args.root, val, first_step=first)
        end = time.perf_counter()
        print(json.dumps({"first_step": first[0] - start, "fit": end - start}))
        return

    import jax

    import jaxlightning as jl

    events = {"compiles": 0, "cache_hits": 0}

    def count(name: str, *a, **k) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            events["compiles"] += 1

    def hits(name: str, **k) -> None:
        if name == "/jax/compilation_cache/cache_hits":
            events["cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    jax.monitoring.register_event_listener(hits)

    class First(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            if not first:
                jax.block_until_ready(trainer._program.held.live_state())
                first.append(time.perf_counter())

    epochs = common.EpochTimes()
    start = time.perf_counter()
    trainer = jl.Trainer(
        max_epochs=args.epochs,
        enable_progress_bar=False,
        enable_model_summary=False,  # as the Lightning arm
        default_root_dir=args.root,
        compilation_cache_dir=args.cache,
        callbacks=[First(), epochs],
        data_on_device=not args.host and "auto",
    )
    trainer.fit(common.LitMLP(), train, val)
    end = time.perf_counter()
    from jaxlightning.xla import compiling

    # The event fires for cache hits too, and for a compile the backend refused
    # at once for an option it does not know (retried without it).
    compiled = events["compiles"] - events["cache_hits"] - compiling.rejected_attempts()
    print(
        json.dumps(
            {
                "first_step": first[0] - start,
                "fit": end - start,
                "compiled": compiled,
                "cache_hits": events["cache_hits"],
                "epochs": epochs.times,
            }
        )
    )


if __name__ == "__main__":
    main()
