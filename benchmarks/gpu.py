"""GPU benchmark (issue 39 item 4): `python -m benchmarks.gpu [--quick] [--out FILE.json]`.

`examples/gpt.py`'s model (``LitGPT``: blocks in ``nn.scan``, dropout 0.1,
AdamW with warmup + cosine, gradient clipping 1.0, the example's training
settings) trained by `jl.Trainer` against a bare ``jax.jit`` loop over the
same DataLoader (the same model, optimizer chain, schedule, initial
parameters and batches), in float32 (``"32-true"``) and ``"bf16-mixed"``
(the bare loop casts its floating parameters to bfloat16 for the forward and
backward passes and keeps float32 masters, the loss summed in float32).

The four arms run side by side in one process, interleaved over rounds
(Trainer fp32, bare fp32, Trainer bf16, bare bf16 in each round). Each run of
an arm trains ``warmup + steps`` steps from the same initial parameters and
times the ``steps`` after the warm-up (compiles and the first steps excluded),
the device work included (blocked on the state at both ends). Reported:
sequences/s and tokens/s (predicted tokens, ``context`` per sequence) of the
median round, Trainer/bare and bf16/fp32 ratios as medians of per-round ratios.
The Trainer's programs go to a persistent compilation cache, so its rounds
after the first load them instead of compiling again (start-up is not timed).

``--data FILE`` adds arm 11's results (``python -m benchmarks.run --groups
data --out FILE``) to the markdown report and the JSON.
"""

from __future__ import annotations

import os

# One CPU device where the CPU is the platform (`examples/gpt.py` would ask for
# 8 simulated ones); the flag only concerns the host platform, so a GPU is unaffected.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import jaxlightning as jl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The Trainer reports every `log_every` steps (its default, 50): the warm-up
# holds the first report (whose program loads or compiles then), the timed
# window the steady one report per 50 steps.
FULL = {
    "layers": 4, "d_model": 512, "heads": 8, "batch": 32, "context": 256,
    "warmup": 55, "steps": 50, "rounds": 3, "log_every": 50,
}  # fmt: skip
QUICK = {
    "layers": 2, "d_model": 32, "heads": 4, "batch": 8, "context": 32,
    "warmup": 3, "steps": 4, "rounds": 2, "log_every": 2,
}  # fmt: skip
# examples/gpt.py divides the attention scores by a numpy float32 scalar,
# which is not weakly typed: under bfloat16 parameters the scores, and from
# them the attention output projection, the residual stream and the MLP, are
# computed in float32 (in the Trainer and the bare loop alike). --fix-scale
# loads the example with the scalar in the scores' dtype.
SCALE_AS_IS = "/ np.sqrt(hd).astype(np.float32)"
SCALE_FIXED = "/ np.sqrt(hd).astype(q.dtype)"
CLIP = 1.0  # the example's gradient_clip_val
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}
_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f} s] {msg}", flush=True)


def load_gpt(fix_scale: bool = False) -> Any:
    """``examples/gpt.py`` as a module (as `tests.helpers.load_example`, whose
    module also imports scikit-learn); ``fix_scale``: see `SCALE_FIXED`."""
    import types

    name = "example_gpt_fixed" if fix_scale else "example_gpt"
    if name in sys.modules:
        return sys.modules[name]
    path = ROOT / "examples" / "gpt.py"
    source = path.read_text()
    if fix_scale:
        if SCALE_AS_IS in source:
            source = source.replace(SCALE_AS_IS, SCALE_FIXED)
        else:
            log(f"--fix-scale: {SCALE_AS_IS!r} is not in {path}; loaded as it is")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # flax modules are dataclasses: they need it
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


class StepWindow(jl.Callback):
    """Wall time of the training steps after the first ``start`` until
    ``stop``, device work included: blocks on the train state at both ends."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.batches = 0
        self.t0 = self.t1 = None

    def on_train_batch_end(self, trainer, module, batch_idx) -> None:
        self.batches += 1
        if self.batches in (self.start, self.stop):
            jax.block_until_ready(trainer._program.held.live_state())
            now = time.perf_counter()
            if self.batches == self.start:
                self.t0 = now
            else:
                self.t1 = now

    @property
    def seconds(self) -> float:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError(f"the fit ran {self.batches} batches, fewer than {self.stop}")
        return self.t1 - self.t0


class GptBench:
    """The shared pieces of the four arms: the model, data, initial parameters."""

    def __init__(self, size: dict[str, int], cache_dir: str, fix_scale: bool = False) -> None:
        self.size, self.cache_dir = size, cache_dir
        self.gpt = load_gpt(fix_scale)
        self.total = size["warmup"] + size["steps"]
        tokens = self.gpt.markov_tokens(self.total * size["batch"], size["context"] + 1)
        # The example's data: a tensor of token rows, unshuffled (the same
        # batches, in order, for every arm), exactly one epoch of `total` steps.
        self.loader = DataLoader(torch.from_numpy(tokens), batch_size=size["batch"])
        module = self.module()
        example = tokens[: size["batch"], :-1]
        self.init = jax.device_get(module.net.init(jax.random.PRNGKey(0), example))
        self._bare_steps: dict[str, Any] = {}

    def module(self) -> Any:
        s = self.size
        return self.gpt.LitGPT(
            d_model=s["d_model"], heads=s["heads"], layers=s["layers"], context=s["context"]
        )

    # ----------------------------------------------------------- Trainer
    def trainer(self, precision: str) -> dict[str, Any]:
        window = StepWindow(self.size["warmup"], self.total)
        trainer = jl.Trainer(
            max_steps=self.total,
            max_epochs=1,
            devices=1,
            precision=precision,
            gradient_clip_val=CLIP,
            log_every_n_steps=self.size["log_every"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            log_loss=True,  # the loss each arm reports
            compilation_cache_dir=self.cache_dir,
            callbacks=[window],
        )
        module = self.module()
        module.variables = self.init
        start = time.perf_counter()
        trainer.fit(module, self.loader)
        loss = trainer.callback_metrics.get("train/loss")
        return {
            "seconds": window.seconds,
            "fit_s": time.perf_counter() - start,
            "loss": None if loss is None else float(loss),
            "data_path": trainer.data_path,
        }

    # ---------------------------------------------------------- bare jit
    def _tx(self) -> Any:
        """LitGPT.configure_optimizers for ``total`` steps, clipping in front."""
        hp = self.module().hparams
        warmup = max(int(hp.warmup * self.total), 1)
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, hp.lr, warmup, max(self.total, warmup + 1)
        )
        return optax.chain(
            optax.clip_by_global_norm(CLIP), optax.adamw(schedule, weight_decay=0.01)
        )

    def _bare_step(self, precision: str) -> Any:
        if precision in self._bare_steps:
            return self._bare_steps[precision]
        net, tx = self.module().net, self._tx()
        half = precision == "bf16-mixed"

        def cast(tree: Any) -> Any:  # float leaves (inside flax's Partitioned boxes too)
            return jax.tree.map(
                lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                tree,
            )

        def step(params, opt_state, tokens, i):
            key = jax.random.fold_in(jax.random.PRNGKey(1), i)

            def loss_fn(p):
                p = cast(p) if half else p
                logits = net.apply(p, tokens[:, :-1], train=True, rngs={"dropout": key})
                losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
                return losses.mean(-1).astype(jnp.float32).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._bare_steps[precision] = (jax.jit(step, donate_argnums=(0, 1)), tx)
        return self._bare_steps[precision]

    def bare(self, precision: str) -> dict[str, Any]:
        step, tx = self._bare_step(precision)
        start = time.perf_counter()
        params = jax.device_put(self.init)
        opt_state = tx.init(params)
        t0 = None
        loss = None
        for i, batch in enumerate(self.loader):
            if i == self.size["warmup"]:
                jax.block_until_ready((params, opt_state))
                t0 = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, batch.numpy(), np.int32(i))
        jax.block_until_ready((params, opt_state))
        t1 = time.perf_counter()
        return {"seconds": t1 - t0, "fit_s": t1 - start, "loss": float(loss)}


def gpt_arm(size: dict[str, int], fix_scale: bool = False) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="jl-gpu-cache-")
    bench = GptBench(size, cache, fix_scale)
    arms = {
        f"{who}_{p}": (getattr(bench, who), PRECISIONS[p])
        for p in PRECISIONS
        for who in ("trainer", "bare")
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for r in range(size["rounds"]):
        for name, (fn, precision) in arms.items():
            res = fn(precision)
            runs[name].append(res)
            seq = size["steps"] * size["batch"] / res["seconds"]
            log(
                f"round {r + 1}/{size['rounds']} {name:13} {seq:10.1f} seq/s "
                f"(window {res['seconds']:.3f} s, whole run {res['fit_s']:.1f} s, "
                f"loss {res['loss']})"
            )
    seqs = size["steps"] * size["batch"]
    out: dict[str, Any] = {"size": size, "fix_scale": fix_scale, "arms": {}}
    for name, rs in runs.items():
        t = _median([r["seconds"] for r in rs])
        row = {
            "seq_per_s": seqs / t,
            "tokens_per_s": seqs * size["context"] / t,
            "window_s": [r["seconds"] for r in rs],
            "run_s": [r["fit_s"] for r in rs],
            "final_loss": rs[-1]["loss"],
        }
        if "data_path" in rs[-1]:
            row["data_path"] = rs[-1]["data_path"]
        out["arms"][name] = row

    def ratio(slow: str, fast: str) -> float:
        """Median per-round throughput of ``fast`` over ``slow`` (time of slow / fast)."""
        pairs = zip(runs[slow], runs[fast], strict=True)
        return _median([s["seconds"] / f["seconds"] for s, f in pairs])

    out["ratios"] = {
        "trainer_over_bare_fp32": ratio("bare_fp32", "trainer_fp32"),
        "trainer_over_bare_bf16": ratio("bare_bf16", "trainer_bf16"),
        "bf16_over_fp32_trainer": ratio("trainer_fp32", "trainer_bf16"),
        "bf16_over_fp32_bare": ratio("bare_fp32", "bare_bf16"),
    }
    return out


# ------------------------------------------------------------------ report
def markdown(results: dict[str, Any]) -> str:
    gpt = results.get("gpt")
    lines = [f"device: {results['device']}, jax {results['jax']}", ""]
    if gpt:
        s = gpt["size"]
        lines += [
            f"GPT ({s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, "
            f"{s['batch']} x {s['context']} tokens): {s['rounds']} rounds x {s['steps']} "
            f"steps after {s['warmup']} warm-up steps, median round"
            + (" (attention scale in the compute dtype: --fix-scale)" if gpt["fix_scale"] else ""),
            "",
            "| arm | precision | seq/s | tokens/s | windows (s) | loss (Trainer: last report; "
            "bare: last step) |",
            "|---|---|---:|---:|---|---:|",
        ]
        for name, row in gpt["arms"].items():
            who, prec = name.split("_")
            windows = ", ".join(f"{w:.3f}" for w in row["window_s"])
            loss = "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}"
            who = "Trainer" if who == "trainer" else "bare jit"
            if "data_path" in row:
                who += f" (data: {row['data_path']})"
            lines.append(
                f"| {who} | {prec} | {row['seq_per_s']:,.0f} | {row['tokens_per_s']:,.0f} "
                f"| {windows} | {loss} |"
            )
        lines += ["", "| ratio (median of per-round ratios) | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in gpt["ratios"].items()]
    data = results.get("data")
    if data:
        lines += ["", "Arm 11 (data path, `benchmarks.run --groups data`):", ""]
        lines += ["| arm | epoch s | samples/s |", "|---|---:|---:|"]
        ratios = []
        for k, v in data.items():
            if isinstance(v, dict) and "epoch_s" in v:
                lines.append(f"| {k} | {v['epoch_s']:.4f} | {v['samples_per_s']:,.0f} |")
            elif isinstance(v, float) and k != "seconds":
                ratios.append((k, v))
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in ratios]
    elif "data_error" in results:
        lines += ["", f"Arm 11: {results['data_error']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int, help="timed steps per run of an arm")
    p.add_argument("--warmup", type=int, help="untimed steps before them")
    p.add_argument("--fix-scale", action="store_true", help="see SCALE_FIXED")
    p.add_argument("--data", help="arm 11's JSON from benchmarks.run, to include")
    p.add_argument("--no-gpt", action="store_true", help="only report --data")
    args = p.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    for key in ("rounds", "steps", "warmup"):
        if getattr(args, key):
            size[key] = getattr(args, key)

    dev = jax.devices()[0]
    results: dict[str, Any] = {
        "device": f"{len(jax.devices())} x {dev.device_kind} ({dev.platform})",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "quick": args.quick,
        "default_matmul_precision": str(jax.config.jax_default_matmul_precision),
    }
    log(f"{results['device']}, jax {jax.__version__}, sizes {size}")
    if args.data:
        try:
            results["data"] = json.loads(Path(args.data).read_text())["groups"]["data"]["data_path"]
        except (OSError, KeyError, ValueError) as e:
            results["data_error"] = f"no results from {args.data}: {e!r}"
    if not args.no_gpt:
        results["gpt"] = gpt_arm(size, args.fix_scale)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    report = markdown(results)
    out.with_suffix(".md").write_text(report + "\n")
    print()
    print(report, flush=True)
    print(f"\nwritten to {out} and {out.with_suffix('.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
