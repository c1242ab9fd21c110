"""LoRA: low-rank adapters beside a model's frozen weight matrices.

A targeted matrix ``W`` (a ``Dense`` kernel, ``(in, out)``) gets two new
parameters, ``A`` ``(in, rank)`` and ``B`` ``(rank, out)``, stored beside it in
the params tree as ``<name>_lora_a`` and ``<name>_lora_b``. Every hook then
sees the model's own tree with ``W + alpha / rank * A @ B`` in its place, so
any linen or NNX model takes adapters without a change to its code, and the
pretrained names stay as they were for loading and export. ``B`` starts at
zero: before the first update the model computes exactly what it did.

The rest of the tree is frozen: the optimizer keeps no state for it and leaves
it bitwise unchanged (`frozen_base`), gradients do not flow into it (a
``stop_gradient``), and checkpoints hold only the adapters (`adapters_only`,
`with_base`). `merged` gives the full weights to export.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def _is_adapter(key: str) -> bool:
    return key.endswith((SUFFIX_A, SUFFIX_B))


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters for the weight matrices whose path matches ``targets``.

    Set it on a module (``self.lora = jl.LoRA(rank=8, targets=r"(q|v)_proj/kernel$")``
    in ``__init__``); the Trainer adds the adapters after ``setup`` (or the
    module's ``pretrained`` weights) and trains only them.

    Args:
        rank: the adapters' inner dimension.
        alpha: the update is scaled by ``alpha / rank`` (default ``alpha = rank``,
            a scale of 1; PEFT's ``lora_alpha``).
        targets: a regular expression searched in each parameter's path within
            ``params`` (keys joined by ``/``, e.g. ``layers_0/self_attn/q_proj/kernel``);
            matching arrays of two or more axes get adapters (the first axis is
            the input's, the rest the output's).
    """

    rank: int
    alpha: float | None = None
    targets: str = r"kernel$"

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRA(rank={self.rank!r}): the rank is a positive integer")
        try:
            re.compile(self.targets)
        except re.error as exc:
            raise ValueError(
                f"LoRA(targets={self.targets!r}) is not a regular expression: {exc}"
            ) from exc

    @property
    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    # ------------------------------------------------------------ building
    def adapt(self, variables: Mapping[str, Any], rng: jax.Array) -> dict[str, Any]:
        """``variables`` with adapters beside each targeted matrix (kept where
        they are already: a second fit goes on with its trained adapters)."""
        found: list[str] = []
        params = self._adapted(variables["params"], "", rng, found)
        if not found:
            paths = [p for p, _ in _leaves(variables["params"])][:8]
            raise ValueError(
                f"LoRA(targets={self.targets!r}) matches no parameter of two or more axes; "
                f"the params tree has {paths}...: write a pattern that matches the "
                "matrices to adapt"
            )
        return {**variables, "params": params}

    def _adapted(
        self, tree: Mapping[str, Any], prefix: str, rng: jax.Array, found: list[str]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping):
                out[key] = self._adapted(value, path + "/", rng, found)
                continue
            out[key] = value
            if _is_adapter(key) or jnp.ndim(value) < 2 or not re.search(self.targets, path):
                continue
            found.append(path)
            if key + SUFFIX_A in tree:
                continue
            shape, dtype = jnp.shape(value), jnp.result_type(value)
            bound = 1.0 / shape[0] ** 0.5  # PEFT's default: kaiming-uniform A, zero B
            key_a = jax.random.fold_in(rng, len(found))
            out[key + SUFFIX_A] = jax.random.uniform(
                key_a, (shape[0], self.rank), dtype, -bound, bound
            )
            out[key + SUFFIX_B] = jnp.zeros((self.rank, *shape[1:]), dtype)
        return out

    # ------------------------------------------------------------- applying
    def apply(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The model's own tree for its hooks: each targeted matrix merged with
        its adapters, the frozen weights behind a ``stop_gradient``."""
        return {**variables, "params": _merge(variables["params"], self.scale, frozen=True)}

    def merged(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The full weights with the adapters folded in (for export)."""
        return {**variables, "params": _merge(variables["params"], self.scale, frozen=False)}

    # ------------------------------------------------ optimizer, checkpoints
    def frozen_base(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx`` on the adapters; the frozen weights get no update and no state."""
        return optax.multi_transform({"adapter": tx, "frozen": optax.set_to_zero()}, labels)


def labels(params: Mapping[str, Any]) -> dict[str, Any]:
    """``"adapter"`` or ``"frozen"`` for each leaf of ``params``."""
    return {
        key: labels(value)
        if isinstance(value, Mapping)
        else ("adapter" if _is_adapter(key) else "frozen")
        for key, value in params.items()
    }


def _merge(tree: Mapping[str, Any], scale: float, *, frozen: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out[key] = _merge(value, scale, frozen=frozen)
        elif not _is_adapter(key):
            base = jax.lax.stop_gradient(value) if frozen else value
            if key + SUFFIX_A in tree:
                a, b = tree[key + SUFFIX_A], tree[key + SUFFIX_B]
                delta = jnp.tensordot(a, b, axes=1) * jnp.asarray(scale, a.dtype)
                base = base + delta.astype(jnp.result_type(value))
            out[key] = base
    return out


def adapters_only(params: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters of ``params`` (the tree a checkpoint keeps)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            inner = adapters_only(value)
            if inner:
                out[key] = inner
        elif _is_adapter(key):
            out[key] = value
    return out


def with_base(params: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with its adapters replaced by ``adapters`` (restored ones)."""
    out = dict(params)
    for key, value in adapters.items():
        out[key] = with_base(params[key], value) if isinstance(value, Mapping) else value
    return out


def adapters_alone(variables: Any) -> bool:
    """Whether ``variables`` hold LoRA adapters and no other parameter (what an
    adapter checkpoint restores): the frozen weights must come from elsewhere."""
    params = variables.get("params") if isinstance(variables, Mapping) else None
    found = _leaves(params) if isinstance(params, Mapping) else []
    return bool(found) and all(_is_adapter(path.rsplit("/", 1)[-1]) for path, _ in found)


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    found = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            found += _leaves(value, f"{prefix}{key}/")
        else:
            found.append((f"{prefix}{key}", value))
    return found
