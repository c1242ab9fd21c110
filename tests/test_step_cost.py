"""`StepCost`'s FLOPs with loops: XLA's cost analysis counts a while loop's
body once, so `step_cost` adds the counts a known trip count says it leaves
out (issue 43). Checked against the same programs unrolled, against counts by
hand (2*m*n*k per matrix product), and through the Trainer's figures."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import jaxlightning as jl
from jaxlightning.xla import cost as cost_module
from jaxlightning.xla.cost import step_cost, uncounted_flops
from tests.helpers import LitMLP, digits, load_example, loader, quiet_trainer

gpt = load_example("gpt")

N = 48  # the matrices of the jitted examples: n x n


def _compiled(fn, *args):
    return jax.jit(fn).trace(*args).lower().compile()


def _xla_flops(compiled) -> float:
    costs = compiled.cost_analysis()
    return (costs[0] if isinstance(costs, (list, tuple)) else costs)["flops"]


def _matmuls(x, w, times):
    for _ in range(times):
        x = x @ w
    return x


def _scanned(x, w, times):
    return jax.lax.scan(lambda c, _: (c @ w, None), x, length=times)[0]


def test_a_loop_body_counts_as_often_as_the_loop_runs():
    """A scan of 6 matrix products: XLA alone counts 1 of them; `step_cost`
    counts 6, as for the same products unrolled and by hand."""
    x = w = jnp.ones((N, N))
    scanned = _compiled(lambda x, w: _scanned(x, w, 6), x, w)
    unrolled = _compiled(lambda x, w: _matmuls(x, w, 6), x, w)
    by_hand = 6 * 2 * N**3
    assert _xla_flops(scanned) == pytest.approx(by_hand / 6, rel=0.01)  # the undercount
    cost = step_cost(scanned)
    assert cost.flops == pytest.approx(by_hand, rel=0.01)
    assert cost.flops == pytest.approx(step_cost(unrolled).flops, rel=0.01)
    assert cost.loops_counted_once == 0 and "at least" not in cost.describe()


def test_nested_loops_multiply():
    """3 outer iterations of 4 inner products of two: 24 products; and the same
    under ``jax.grad`` (a forward and a backward loop of each)."""

    def nested(x, w):
        def outer(c, _):
            return jax.lax.fori_loop(0, 4, lambda i, c: c @ w @ w, c), None

        return jax.lax.scan(outer, x, length=3)[0]

    x = w = jnp.ones((N, N)) / N
    assert step_cost(_compiled(nested, x, w)).flops == pytest.approx(24 * 2 * N**3, rel=0.01)
    loss = lambda x, w: nested(x, w).sum()  # noqa: E731
    unrolled = lambda x, w: _matmuls(x, w, 24).sum()  # noqa: E731
    grads = step_cost(_compiled(jax.grad(loss, argnums=(0, 1)), x, w)).flops
    by_hand = 3 * 24 * 2 * N**3  # forward, and each product's two gradients
    assert grads == pytest.approx(by_hand, rel=0.03)
    assert grads == pytest.approx(
        step_cost(_compiled(jax.grad(unrolled, argnums=(0, 1)), x, w)).flops, rel=0.03
    )


def test_a_loop_of_unknown_length_is_counted_once_and_said_so():
    """A while loop whose condition reads data: no trip count to read, so its
    body is counted once and the figure is named a lower bound."""

    def until_large(x, w):
        return jax.lax.while_loop(lambda c: c.sum() < 1e6, lambda c: c @ w, x)

    x = w = jnp.ones((N, N))
    with pytest.warns(UserWarning, match=r"1 while loop\(s\) whose trip count is unknown"):
        cost = step_cost(_compiled(until_large, x, w))
    assert cost.loops_counted_once == 1
    assert cost.flops >= 2 * N**3
    assert cost.describe().startswith("at least ")
    assert "(1 loop(s) of unknown trip count counted once)" in cost.describe()


def _gpt_fit(scan: bool, monitor: jl.callbacks.ThroughputMonitor | None = None) -> jl.Trainer:
    tokens = DataLoader(torch.from_numpy(gpt.markov_tokens(16, 17)), 8)
    # dropout 0: the CPU backend's random bits are integer loops XLA also counts
    model = gpt.LitGPT(d_model=64, heads=4, layers=2, context=16, dropout=0.0, scan=scan)
    trainer = quiet_trainer(
        max_steps=3 if monitor else 1, devices=1, num_sanity_val_steps=0,
        log_every_n_steps=2, callbacks=[monitor] if monitor else [],
    )  # fmt: skip
    trainer.fit(model, tokens)
    return trainer


def test_scanned_gpt_counts_the_flops_of_its_unrolled_twin():
    """examples/gpt.py with its blocks in an ``nn.scan`` and unrolled: the train
    steps' FLOPs agree within 2% (XLA's own count of the scanned one was 0.54x
    the unrolled one's). What remains is real: the scanned backward loop
    recomputes a few elementwise results that the unrolled program shares.
    ThroughputMonitor's FLOP/s and MFU read the corrected figure."""
    monitor = jl.callbacks.ThroughputMonitor(peak_flops=1e12)
    scanned = _gpt_fit(True, monitor)
    unrolled = _gpt_fit(False)
    flops = scanned.train_step_cost().flops
    assert flops == pytest.approx(unrolled.train_step_cost().flops, rel=0.02)
    assert scanned.train_step_cost().loops_counted_once == 0
    m = scanned.callback_metrics
    assert m["throughput/flops_per_sec"] == pytest.approx(flops / m["throughput/step_time"])
    assert m["throughput/mfu"] == pytest.approx(m["throughput/flops_per_sec"] / 1e12)


def test_dense_mlp_train_step_flops_match_a_count_by_hand():
    """A dense MLP (64 -> 512 -> 512 -> 10, 64 rows, SGD): the matrix products
    by hand are 2*m*n*k each; the forward's, the weights' gradients (as many
    again) and the inputs' gradients (as many, except the first layer's, which
    nothing needs). XLA counts the rest too: biases, ReLUs, the softmax and loss
    (O(rows x width), 1/width of a product's count), and the SGD update (a few
    per parameter, about 2/(3*rows) of the products'): under 2% here."""
    rows, hidden = 64, 512
    trainer = quiet_trainer(max_steps=1, devices=1, num_sanity_val_steps=0)
    trainer.fit(LitMLP(hidden=hidden, lr=0.0), loader(*digits(rows), rows))  # lr 0: SGD
    layers = [(64, hidden), (hidden, hidden), (hidden, 10)]
    forward = sum(2 * rows * n * k for n, k in layers)
    by_hand = 3 * forward - 2 * rows * 64 * hidden
    cost = trainer.train_step_cost()
    assert by_hand <= cost.flops <= 1.02 * by_hand, (cost.flops, by_hand)
    assert cost.loops_counted_once == 0


def test_a_constant_printed_without_its_value_still_lets_the_body_be_counted():
    """A loop body holding a large constant (XLA's text elides its value): the
    body is parsed with zeros in its place and counted."""
    table = np.arange(N * N, dtype=np.float32).reshape(N, N) / N**2

    def with_table(x):
        return jax.lax.scan(lambda c, _: (c @ jnp.asarray(table) + c, None), x, length=5)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no loop left counted once
        cost = step_cost(_compiled(with_table, jnp.ones((N, N))))
    assert cost.flops == pytest.approx(5 * (2 * N**3 + N * N), rel=0.02)


# A GPU module as XLA prints it after optimisation, cut down: a cuBLAS product
# before a loop of 5 and one in its body (output: the result and a workspace).
_GEMM = (
    'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{'
    '"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}'
)
_GPU_MODULE = f"""HloModule gemms, is_scheduled=true

%body (p: (s32[], f32[64,32])) -> (s32[], f32[64,32]) {{
  %p = (s32[], f32[64,32]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,32]{{1,0}} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %w = f32[32,32]{{1,0}} constant({{...}})
  %gemm = (f32[64,32]{{1,0}}, s8[1024]{{0}}) custom-call(%x, %w), {_GEMM}
  %y = f32[64,32]{{1,0}} get-tuple-element(%gemm), index=0
  %z = f32[64,32]{{1,0}} add(%y, %x)
  ROOT %t = (s32[], f32[64,32]{{1,0}}) tuple(%next, %z)
}}

%cond (q: (s32[], f32[64,32])) -> pred[] {{
  %q = (s32[], f32[64,32]{{1,0}}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}}

ENTRY %main (a: f32[64,16], b: f32[16,32]) -> f32[64,32] {{
  %a = f32[64,16]{{1,0}} parameter(0)
  %b = f32[16,32]{{1,0}} parameter(1)
  %gemm.1 = (f32[64,32]{{1,0}}, s8[1024]{{0}}) custom-call(%a, %b), {_GEMM}
  %y.1 = f32[64,32]{{1,0}} get-tuple-element(%gemm.1), index=0
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,32]{{1,0}}) tuple(%zero, %y.1)
  %loop = (s32[], f32[64,32]{{1,0}}) while(%init), condition=%cond, body=%body, \
backend_config={{"known_trip_count":{{"n":"5"}}}}
  ROOT %out = f32[64,32]{{1,0}} get-tuple-element(%loop), index=1
}}
"""


class _GpuCompiled:
    """What `uncounted_flops` reads of a compiled GPU step: its module's text,
    and a client that analyses no module of its own (as the GPU plugin's)."""

    def runtime_executable(self):
        return self

    client = None  # not a client: the CPU's analyses the loop body

    def hlo_modules(self):
        return [self]

    def to_string(self, options):
        return _GPU_MODULE


def test_cublas_products_count_as_often_as_they_run_once_and_only_once():
    """XLA counts a cuBLAS custom call as no FLOPs (an H200's count of a
    4-block model of width 512 was a third of its products): each is counted
    as its product, 2*m*n*k, as often as its loop runs; where XLA's figure
    already holds them once, only the repeats are added."""
    first, inner = 2 * 64 * 16 * 32, 2 * 64 * 32 * 32
    body = 64 * 32  # the residual add (and a scalar counter, a flop at most)
    xla = body  # XLA's count: the body and the condition once, no products
    extra, uncounted = uncounted_flops(_GpuCompiled(), xla)
    assert uncounted == 0
    assert extra == pytest.approx(4 * body + first + 5 * inner, abs=8)
    with_products = xla + first + inner  # a count that held them once
    extra, _ = uncounted_flops(_GpuCompiled(), with_products)
    assert extra == pytest.approx(4 * body + 4 * inner, abs=8)


def test_without_xlas_private_module_api_every_loop_is_counted_once_and_said_so(monkeypatch):
    """The HLO module API comes from jaxlib's private modules (guarded): where a
    jax version moves them, XLA's own count stands and each loop is named as
    counted once, instead of a failing fit."""

    def scanned(x, w):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=6)[0]

    x = w = jnp.ones((N, N))
    compiled = _compiled(scanned, x, w)
    xla_only = float(compiled.cost_analysis()["flops"])
    monkeypatch.setattr(cost_module, "_private_xla", lambda: None)
    with pytest.warns(UserWarning, match=r"1 while loop\(s\) whose trip count is unknown"):
        cost = step_cost(compiled)
    assert cost.flops == xla_only
    assert cost.loops_counted_once == 1
