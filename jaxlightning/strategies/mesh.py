"""Sharded strategies: the train state split over a device mesh, not replicated.

Both run the per-device parts of a step (loss, gradient, logged values) in a
``jax.shard_map`` that is manual over the data axis `AXIS` only, so per-device
keys, padding masks, ``self.log`` and SyncBatchNorm behave exactly as under data
parallelism; the optimizer update runs outside it, on globally sharded arrays
under ``jax.jit``, where XLA keeps every elementwise update on its shard and
computes global reductions (``clip_by_global_norm`` in an optax chain) right.

* `FSDPStrategy`: parameters, gradients and optimizer state sharded over the
  data axis (ZeRO-3 at rest). A step gathers the parameters for the forward and
  backward passes and reduce-scatters the gradients, so each device updates
  only its shard of the parameters and optimizer state.
* `ModelParallelStrategy`: a 2-D mesh ``(batch, model)``; parameters are placed
  by the model's partitioning annotations over ``model`` (tensor parallelism:
  XLA partitions the matmuls and adds the collectives, as in the Megatron
  layout) and replicated over ``batch``; batches are split over ``batch``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlightning.strategies.shard_map import ShardMapStrategy, per_device, spec
from jaxlightning.training.precision import compute_dtype_now
from jaxlightning.training.step import AXIS, gradient_view

MODEL_AXIS = "model"
_SHARDED_PARTS = ("params", "opt_state", "grad_sum")


def _path_str(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def largest_divisible_dim(shape: tuple[int, ...], n: int, min_size: int) -> int | None:
    """The dimension FSDP shards an array of ``shape`` along over ``n`` devices:
    the largest one divisible by ``n`` (the first of equals); ``None`` (kept
    whole on every device) for arrays under ``min_size`` elements or with no
    such dimension."""
    if int(np.prod(shape, dtype=np.int64)) < min_size:
        return None
    dims = [d for d, size in enumerate(shape) if size % n == 0 and size >= n]
    if not dims:
        return None
    return max(dims, key=lambda d: (shape[d], -d))


class MeshStrategy(ShardMapStrategy):
    """Common ground of the sharded strategies: a mesh, a sharding per state leaf.

    Subclasses say how each leaf of the train state is laid out: by its path and
    shape (`leaf_spec`, FSDP) or by the model's annotations (`_specs`, tensor
    parallel). Batches are split over the data axis only.
    """

    name = "mesh"

    def __init__(self, *, model: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(model, int) or model < 1:
            raise ValueError(f"model={model!r}: the model axis needs a positive device count")
        self.model_size = model
        self._state_shardings: Any = None
        self._param_specs: Any = None
        self._layer_names: Any = None

    def setup(self, devices: Sequence[jax.Device]) -> None:
        super().setup(devices)
        n = len(self.devices)
        if n % self.model_size:
            raise ValueError(
                f"{type(self).__name__}: model={self.model_size} does not divide the "
                f"{n} devices; the mesh is (data={n}/model, model)"
            )
        local = self.num_local_devices
        if local % self.model_size:
            raise ValueError(
                f"model={self.model_size} does not divide the {local} devices of this "
                "process: a model group must not span processes"
            )
        grid = np.asarray(self.devices).reshape(n // self.model_size, self.model_size)
        self.mesh = Mesh(grid, (self.axis_name, MODEL_AXIS))
        self._replicated = NamedSharding(self.mesh, P())
        self._sharded = NamedSharding(self.mesh, P(self.axis_name))
        self._host_is_device = False  # batches are placed: params are not replicated

    @property
    def num_local_shards(self) -> int:
        return self.num_local_devices // self.model_size

    @property
    def data_size(self) -> int:
        """Devices along the data axis: how many ways each batch is split."""
        return len(self.devices) // self.model_size

    # ---------------------------------------------------------------- layout
    def leaf_spec(self, path: str, leaf: Any) -> P:
        """The `PartitionSpec` of one state leaf (``path``: slash-joined keys)."""
        raise NotImplementedError

    def plan(self, annotated: Callable[[], Any]) -> Any:
        """Records (and returns) the sharding of every leaf of the train state,
        from its abstract shapes (partitioning annotations still boxed)."""
        abstract_state = annotated()
        specs = self._specs(abstract_state)
        flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(abstract_state))[0]
        for (path, leaf), spec_ in zip(flat, jax.tree.leaves(specs, is_leaf=_is_spec), strict=True):
            self._check_fits(_path_str(path), leaf.shape, spec_)
        self._state_shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=_is_spec
        )
        self._param_specs = specs.params
        # Parameters annotated with the data axis, gathered by the model's
        # `fsdp_gathered` layers: their annotation names, to box them with.
        self._layer_names = jax.tree.map(
            lambda leaf: leaf.names if _names_axis(leaf, self.axis_name) else None,
            abstract_state.params,
            is_leaf=lambda x: isinstance(x, nn.Partitioned),
        )
        return self._state_shardings

    def plan_variables(self, annotated: Callable[[], Any]) -> Any:
        """Shardings of flax variables alone (evaluation outside `fit`)."""
        specs = self._specs(annotated(), variables=True)
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=_is_spec)

    def place_variables(self, tree: Any, annotated: Callable[[], Any]) -> Any:
        return jax.device_put(tree, self.plan_variables(annotated))

    def _specs(self, tree: Any, *, variables: bool = False) -> Any:
        def spec(path: Any, leaf: Any) -> P:
            key = _path_str(path)
            if variables:
                key = key if key.startswith("params") else "model_state/" + key
            return self.leaf_spec(key, leaf)

        return jax.tree_util.tree_map_with_path(spec, nn.meta.unbox(tree))

    def _check_fits(self, path: str, shape: tuple[int, ...], spec: P) -> None:
        sizes = dict(self.mesh.shape)
        for dim, axes in enumerate(spec):
            if axes is None:
                continue
            for axis in (axes,) if isinstance(axes, str) else axes:
                if axis not in sizes:
                    raise ValueError(
                        f"{path} is partitioned over mesh axis {axis!r}, but the mesh has "
                        f"axes {sorted(sizes)}; annotate with {sorted(sizes)} or give "
                        "logical_rules that map your logical names to them"
                    )
                if dim >= len(shape) or shape[dim] % sizes[axis]:
                    raise ValueError(
                        f"{path} has shape {tuple(shape)}: dimension {dim} cannot be split "
                        f"{sizes[axis]} ways over mesh axis {axis!r}; change the layer's "
                        "size or the mesh"
                    )

    def place_state(self, tree: Any) -> Any:
        if self._state_shardings is None:
            raise RuntimeError("plan() must run before the state is placed")
        return jax.device_put(tree, self._state_shardings)

    def checkpoint_arrays(self, tree: Any) -> Any:
        # Kept as global arrays: orbax writes each process's shards itself.
        return tree

    # ---------------------------------------------------------------- compile
    def compile(
        self,
        fn: Callable[..., Any],
        *,
        sharded_args: Sequence[bool],
        sharded_out: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        # Non-batch arguments enter whole (P() over the data axis: sharded
        # parameters are gathered at the boundary); the model axis stays
        # automatic, so tensor-parallel layouts pass through.
        axis = self.axis_name
        mapped = self._per_device(
            fn,
            tuple(spec(s, axis) for s in sharded_args),
            jax.tree.map(lambda s: spec(s, axis), sharded_out),
        )
        return jax.jit(mapped, donate_argnums=donate_argnums)

    def _per_device(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Any:
        return per_device(
            fn, self.mesh, in_specs, out_specs, manual_axes=frozenset({self.axis_name})
        )

    def compile_train(self, parts: Any) -> Callable[..., Any]:
        """The train step: per-device gradients, then one sharded update."""

        def view_specs(view: Any) -> Any:
            specs = jax.tree.map(lambda _: P(), view)
            if self.gathering() is None:
                return specs
            return specs.replace(params=self._data_specs())

        def gradients(view: Any, batch: Any, rows: Any) -> Any:
            mapped = self._per_device(
                parts.gradients,
                (view_specs(view), P(self.axis_name), P(self.axis_name)),
                (self._grad_specs(), P(), P()),
            )
            return mapped(view, batch, rows)

        def jl_sharded_train_step(state, acc, batch, rows):
            return parts.apply(state, acc, *gradients(gradient_view(state), batch, rows))

        return jax.jit(
            jl_sharded_train_step,
            out_shardings=(self._state_shardings, self._replicated),
            donate_argnums=(0,),
        )

    def compile_manual(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Manual optimization: its optimizer steps run inside the per-device
        function, which therefore receives the whole state (under FSDP gathered
        for the step; tensor-parallel arrays stay split over ``"model"``); the
        new state is laid out again as planned."""
        mapped = self._per_device(fn, (P(), P(), P(self.axis_name), P(self.axis_name)), (P(), P()))
        return jax.jit(
            mapped, out_shardings=(self._state_shardings, self._replicated), donate_argnums=(0,)
        )

    def compile_global(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return jax.jit(fn, out_shardings=self._state_shardings, donate_argnums=(0,))

    def _data_specs(self) -> Any:
        """Each parameter's split over the data axis alone: how it enters and
        leaves the per-device gradient function (``"model"`` stays automatic)."""
        axis = self.axis_name
        return jax.tree.map(
            lambda s: P(*(n if n == axis else None for n in s)), self._param_specs, is_leaf=_is_spec
        )

    def _per_layer(self) -> bool:
        return any(n is not None for n in jax.tree.leaves(self._layer_names))

    def _gathers_at_start(self) -> bool:
        """Whether the step gathers parameters split over the data axis at its
        start (FSDP); otherwise only `fsdp_gathered` layers' are split there."""
        return False

    def _grad_specs(self) -> Any:
        return self._data_specs() if self.gathering() is not None else P()

    def reduce_grads(self) -> Callable[[Any], Any] | None:
        if self.gathering() is None:
            return None  # one psum, with the logged values
        # The split arrays' gradients come out of the gather's transpose
        # reduce-scattered already; the whole arrays' are summed here.
        axis = self.axis_name
        specs = self._data_specs()

        def reduce(grads: Any) -> Any:
            def one(g: jax.Array, spec: P) -> jax.Array:
                return g if axis in spec else jax.lax.psum(g, axis)

            return jax.tree.map(one, grads, specs, is_leaf=_is_spec)

        return reduce

    def gathering(self) -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
        if not (self._gathers_at_start() or self._per_layer()):
            return None
        axis = self.axis_name
        specs = self._data_specs()
        layer_names = self._layer_names
        per_layer = self._per_layer()

        def gather(params: Any) -> Any:
            def one(p: jax.Array, spec: P, names: tuple[Any, ...] | None) -> Any:
                if names is not None:  # the model's fsdp_gathered layer gathers it
                    return nn.Partitioned(p, names=names)
                if axis not in spec:
                    return p
                return gather_leaf(p, axis, list(spec).index(axis))

            return jax.tree.map(one, params, specs, layer_names, is_leaf=_is_spec)

        def wrap(objective: Callable[..., Any]) -> Callable[..., Any]:
            def of_shards(params: Any) -> Any:
                return objective(gather(params))

            if per_layer:
                # The model's layers gather their own parameters; what is saved
                # for the backward pass is theirs to say (nn.remat). A policy
                # around the whole loss would override theirs.
                return of_shards
            # Gathered at the start: keep everything for the backward pass but
            # the gathered parameters, gathered again where it needs them.
            return jax.checkpoint(of_shards, policy=_not_gathered)

        return wrap

    def precompile(self, compiled: Callable[..., Any], *example: Any) -> Callable[..., Any]:
        """The train step compiled ahead for the planned layout: the example
        state and accumulator are shapes, given the shardings they will be
        called with (state as planned, accumulator replicated); the batches
        are placed already."""
        if jax.process_count() > 1 or self._state_shardings is None:
            return compiled  # in step on every process: the first call compiles
        state, acc, *batch = example

        def placed(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
            dtype = jax.dtypes.canonicalize_dtype(x.dtype)
            return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)

        state = jax.tree.map(placed, state, self._state_shardings)
        acc = jax.tree.map(lambda x: placed(x, self._replicated), acc)
        return super().precompile(compiled, state, acc, *batch)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mesh={dict(self.mesh.shape)})"


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _names_axis(leaf: Any, axis: str) -> bool:
    return isinstance(leaf, nn.Partitioned) and axis in leaf.names


GATHERED = "jl_gathered_param"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of a parameter FSDP gathered
whole for the step: recomputed, not saved, for the backward pass."""


def _not_gathered(prim: Any, *_: Any, **params: Any) -> bool:
    """The `jax.checkpoint` policy of a step that gathers sharded parameters at
    its start: save every value for the backward pass except those gathers (the
    ``all_gather`` over `AXIS` and its named result)."""
    if prim.name == "all_gather":
        return params.get("axis_name") not in (AXIS, (AXIS,))
    return not (prim.name == "name" and params.get("name") == GATHERED)


def gather_leaf(shard: jax.Array, axis: str, dim: int) -> jax.Array:
    """One array made whole from its shards along ``dim`` over ``axis``, named
    `GATHERED` (gathered again for the backward pass, not saved)."""
    dtype = shard.dtype
    if dtype == jnp.bfloat16:
        # XLA's CPU backend aborts compiling a bfloat16 gather's transpose (a
        # reduce-scatter): move float32, which holds every bfloat16 exactly.
        shard = shard.astype(jnp.float32)
    whole = jax.lax.all_gather(shard, axis, axis=dim, tiled=True).astype(dtype)
    return checkpoint_name(whole, GATHERED)


def fsdp_gathered(target: type[nn.Module], *, policy: Callable[..., bool] | None = None) -> Any:
    """A linen module class whose parameters annotated with the data axis
    `jl.AXIS` (``nn.with_partitioning(init, (jl.AXIS, None))``) are gathered
    where it runs, one layer at a time, under `FSDPStrategy`; elsewhere it is
    ``target`` unchanged.

    Under FSDP such an array is split as annotated and reaches the model as a
    shard; the wrapped module gathers it on entry, and the gradient leaves as
    a shard again (the gather's transpose is a reduce-scatter). In a loop over
    layers (``nn.scan`` over the wrapped block) each iteration gathers only its
    own layer, which XLA cannot hoist out of the loop: peak memory holds one
    layer's parameters whole, not the model's.

    The block is rematerialised (``nn.remat``): for the backward pass it keeps
    what ``policy`` saves, a `jax.checkpoint_policies` member, and recomputes
    the rest; its gathered parameters are never saved (gathered again when the
    backward pass reaches it), whatever the policy. The default,
    ``dots_saveable``, keeps the matmul results; ``nothing_saveable`` keeps
    only the block's input (least memory, the whole forward pass again);
    ``dots_with_no_batch_dims_saveable`` keeps the matmuls against the
    parameters but not attention's batched ones.

    Example:
        ``Blocks = nn.scan(jl.fsdp_gathered(Block), variable_axes={"params": 0},
        split_rngs={"params": True}, length=layers,
        metadata_params={nn.PARTITION_NAME: None})``
    """
    if policy is not None and not callable(policy):
        raise TypeError(
            f"fsdp_gathered(policy={policy!r}): expected a jax.checkpoint_policies "
            "member (a function), such as jax.checkpoint_policies.nothing_saveable, "
            "not its name"
        )

    def gather(variables: Any) -> Any:
        try:
            jax.lax.axis_size(AXIS)
        except NameError:  # not in a step (initialisation): nothing is split
            return variables

        def one(leaf: Any) -> Any:
            if not _names_axis(leaf, AXIS):
                return leaf
            dtype = leaf.value.dtype
            whole = gather_leaf(leaf.value, AXIS, leaf.names.index(AXIS))
            # Mixed precision casts here, after the float32 gather (its
            # transpose then sums float32 gradients, as a gather at the start does).
            return whole.astype(compute_dtype_now() or dtype)

        return jax.tree.map(one, variables, is_leaf=lambda x: isinstance(x, nn.Partitioned))

    gathered = nn.map_variables(target, "params", trans_in_fn=gather, init=True)
    chosen = jax.checkpoint_policies.dots_saveable if policy is None else policy

    def saved(prim: Any, *args: Any, **params: Any) -> bool:
        # Never the gathered parameters: a device would hold every layer's.
        return _not_gathered(prim, *args, **params) and bool(chosen(prim, *args, **params))

    return nn.remat(gathered, policy=saved)


class FSDPStrategy(MeshStrategy):
    """Fully sharded data parallel: each device keeps 1/N of the parameters,
    gradients and optimizer state, N the device count.

    Args:
        min_size: arrays with fewer elements stay whole on every device (biases,
            norms: gathering them costs more than they save).
        shard_dim: overrides the automatic choice: ``(path, shape) -> dim or
            None`` for each array of the parameters (``path`` like
            ``"params/Dense_0/kernel"``), optimizer state (paths like
            ``"opt_state/0/mu/Dense_0/kernel"``) and accumulated gradients;
            give an optimizer-state array its parameter's dimension.
        **kwargs: ``max_in_flight`` and ``prefetch_depth``, as for every
            strategy.

    By default an array is split along its largest dimension that the device
    count divides. Parameters are gathered once per step for the forward and
    backward passes (peak memory holds them whole once, with the gradient
    before it is reduce-scattered); between steps, and for the optimizer
    update, every device holds only its shard.
    """

    name = "fsdp"

    def __init__(
        self,
        *,
        min_size: int = 1024,
        shard_dim: Callable[[str, tuple[int, ...]], int | None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model=1, **kwargs)
        self.min_size = min_size
        self.shard_dim = shard_dim

    def leaf_spec(self, path: str, leaf: Any) -> P:
        if not path.startswith(_SHARDED_PARTS):
            return P()
        shape = tuple(np.shape(leaf))
        if self.shard_dim is not None:
            dim = self._chosen_dim(path, shape)
        else:
            dim = largest_divisible_dim(shape, self.data_size, self.min_size)
        if dim is None:
            return P()
        return P(*([None] * dim), self.axis_name)

    def _specs(self, tree: Any, *, variables: bool = False) -> Any:
        # Arrays the model annotates with the data axis (`fsdp_gathered` layers)
        # are split as annotated, and gathered by the model where it uses them;
        # the rest by `leaf_spec`, gathered at the start of the step.
        ruled = super()._specs(tree, variables=variables)
        annotated = nn.get_partition_spec(tree)
        axis = self.axis_name

        def pick(rule: P, names: P) -> P:
            if axis not in names:
                return rule
            return P(*(name if name == axis else None for name in names))

        return jax.tree.map(pick, ruled, annotated, is_leaf=_is_spec)

    def _chosen_dim(self, path: str, shape: tuple[int, ...]) -> int | None:
        """``shard_dim``'s dimension for one array, checked: an index of ``shape``
        (negative ones count from the end) that the device count divides, or
        ``None``."""
        dim = self.shard_dim(path, shape)
        if dim is None:
            return None
        said = f"FSDPStrategy(shard_dim=...) returned {dim!r} for {path} of shape {shape}"
        whole = "None to keep the array whole"
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise TypeError(f"{said}: return a dimension index (an int), or {whole}")
        if not -len(shape) <= dim < len(shape):
            dims = f"dimensions 0 to {len(shape) - 1}" if shape else "no dimensions"
            raise ValueError(f"{said}, which has {dims}; return one of them, or {whole}")
        dim = int(dim) % len(shape)
        if shape[dim] % self.data_size:
            raise ValueError(
                f"{said}: its size {shape[dim]} does not split evenly over the "
                f"{self.data_size} devices; return another dimension, or {whole}"
            )
        return dim

    def _gathers_at_start(self) -> bool:
        return True


class ModelParallelStrategy(MeshStrategy):
    """Tensor parallel over a ``model`` mesh axis, data parallel over ``batch``.

    Example:
        ``jl.ModelParallelStrategy(data=4, model=2)`` on 8 devices.

    Parameters are placed by the model's own annotations: linen
    ``nn.with_partitioning(init, (None, "model"))``, or
    ``nn.with_logical_partitioning(init, ("embed", "mlp"))`` with
    ``logical_rules`` such as ``[("mlp", "model"), ("embed", None)]``. Optimizer
    state follows its parameter; unannotated arrays are replicated.

    Args:
        data: devices along the data axis (default: the device count / model).
        model: devices along the model axis; a model group must sit within one
            process.
        logical_rules: logical axis name -> mesh axis (or ``None``), for
            logically partitioned models.
    """

    name = "model_parallel"

    def __init__(
        self,
        *,
        data: int | None = None,
        model: int = 2,
        logical_rules: Sequence[tuple[str, str | None]] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(model=model, **kwargs)
        self.requested_data = data
        self.logical_rules = tuple(logical_rules)

    def setup(self, devices: Sequence[jax.Device]) -> None:
        if self.requested_data is not None:
            wanted = self.requested_data * self.model_size
            if wanted != len(devices):
                raise ValueError(
                    f"ModelParallelStrategy(data={self.requested_data}, "
                    f"model={self.model_size}) needs {wanted} devices; the Trainer has "
                    f"{len(devices)}. Set Trainer(devices={wanted}) or change data/model"
                )
        super().setup(devices)

    def _specs(self, tree: Any, *, variables: bool = False) -> Any:
        specs = nn.get_partition_spec(tree)
        if self.logical_rules:
            specs = nn.logical_to_mesh(specs, self.logical_rules)
        return specs

    def plan(self, annotated: Callable[[], Any]) -> Any:
        shardings = super().plan(annotated)
        split = [s for s in jax.tree.leaves(self._param_specs, is_leaf=_is_spec) if s != P()]
        if not split:
            warnings.warn(
                f"ModelParallelStrategy: no parameter is partitioned over {MODEL_AXIS!r}, so "
                f"each of the {self.model_size} devices of a model group repeats the same "
                "work. Annotate layers with nn.with_partitioning (or nnx.with_partitioning), "
                "or use the default data-parallel strategy",
                stacklevel=2,
            )
        return shardings
