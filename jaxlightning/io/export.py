"""A trained module's ``predict_step`` as one file that runs without its code.

`export_predict` traces a module's ``predict_step`` (handed over as a
function of the variables and a batch, with the variables: this module knows
no module class) with `jax.export` (StableHLO, for the
platforms asked for; the batch's leading axis symbolic, so any batch size runs)
and writes it to one file with the trained variables. `load_exported` reads the
file back into a callable: inference needs jax and flax, not the module's class,
the Trainer or the training code (Keras' ``model.export``; Lightning's
``to_torchscript``).

The file is msgpack (`flax.serialization`): the serialized `jax.export.Exported`
as bytes and the variables' arrays in their pytree order; the exported function
takes those arrays as a flat list, so no model structure needs rebuilding.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

FORMAT = "jaxlightning-export/1"


def export_predict(
    predict_step: Callable[[Any, Any], Any],
    variables: Any,
    path: str | os.PathLike[str],
    example_batch: Any,
    *,
    platforms: Sequence[str] | None = None,
    any_batch_size: bool = True,
) -> str:
    """Writes ``predict_step(variables, batch)`` with ``variables`` to ``path``;
    see `jaxlightning.JaxModule.export`. Returns the path written."""
    batch = jax.tree.map(np.asarray, example_batch)
    leaves = jax.tree.leaves(batch)
    rows = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if not leaves or None in rows or len(rows) != 1:
        shapes = [leaf.shape for leaf in leaves]
        raise ValueError(
            f"export needs an example batch of arrays with one leading row axis, all the "
            f"same length; got shapes {shapes}. Pass one batch as predict_step receives it"
        )
    flat_vars, var_tree = jax.tree.flatten(jax.tree.map(np.asarray, variables))

    def predict(var_leaves: list[jax.Array], batch: Any) -> Any:
        return predict_step(jax.tree.unflatten(var_tree, var_leaves), batch)

    if any_batch_size:
        (n,) = jax.export.symbolic_shape("batch")
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype), batch)
    else:
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    var_specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat_vars]
    kwargs = {} if platforms is None else {"platforms": tuple(platforms)}
    try:
        exported = jax.export.export(jax.jit(predict), **kwargs)(var_specs, specs)
    except Exception as exc:
        if not any_batch_size:
            raise
        _fails_on_the_example(predict, var_specs, batch)
        raise ValueError(
            f"predict_step could not be exported for any batch size ({type(exc).__name__}: "
            f"{exc}). Code that needs the batch size as a number (a reshape to it, say) "
            "fails there: use -1 in reshapes, or export for the example's batch size only "
            "with any_batch_size=False"
        ) from exc
    payload = {
        "format": FORMAT,
        "exported": np.frombuffer(bytes(exported.serialize()), np.uint8),
        "variables": {str(i): x for i, x in enumerate(flat_vars)},
    }
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(serialization.msgpack_serialize(payload))
    return path


def _fails_on_the_example(predict: Callable[..., Any], var_specs: Any, batch: Any) -> None:
    """Raises what ``predict`` does on the example batch's own shapes, if it
    fails there too: then the batch does not fit the model (a wrong feature
    width, say), whatever its number of rows."""
    try:
        jax.eval_shape(predict, var_specs, batch)
    except Exception as exc:
        shapes = jax.tree.map(lambda x: tuple(x.shape), batch)
        raise ValueError(
            f"predict_step fails on the example batch itself (shapes {shapes}), before "
            f"any batch size is made symbolic: {type(exc).__name__}: {exc}. Pass a batch "
            "as predict_step receives it"
        ) from exc


class ExportedPredict:
    """``predict_step`` read back by `load_exported`: call it on a batch.

    Attributes:
        exported: the `jax.export.Exported` (its ``in_avals``, ``platforms``...).
        variables: the trained arrays, in the order the function takes them.
    """

    def __init__(self, exported: jax.export.Exported, variables: list[np.ndarray]) -> None:
        self.exported = exported
        self.variables = [jnp.asarray(v) for v in variables]

    def __call__(self, batch: Any) -> Any:
        """The predictions for ``batch`` (structured and typed as the example
        batch was; with ``any_batch_size``, of any number of rows)."""
        batch = jax.tree.map(np.asarray, batch)
        return self.exported.call(self.variables, batch)


def load_exported(path: str | os.PathLike[str]) -> Callable[[Any], Any]:
    """Reads a file `export_predict` wrote: an `ExportedPredict`."""
    with open(os.fspath(path), "rb") as f:
        data = f.read()
    try:
        payload = serialization.msgpack_restore(data)
    except Exception:  # not msgpack at all (msgpack's ExtraData, ValueError, ...)
        payload = None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a file written by JaxModule.export ({FORMAT})")
    exported = jax.export.deserialize(bytearray(payload["exported"].tobytes()))
    stored = payload["variables"]
    return ExportedPredict(exported, [stored[str(i)] for i in range(len(stored))])
