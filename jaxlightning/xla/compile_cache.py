"""JAX's persistent compilation cache, for fast start-up of repeated runs."""

from __future__ import annotations

import os

import jax


def enable(path: str | os.PathLike[str]) -> None:
    """Caches compiled programs in ``path``, across processes and runs.

    JAX skips programs that compile faster than a threshold (1 s by default),
    which is every program of a small model; the threshold is lowered to 0 so
    that they are cached too. The setting is process-wide.
    """
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        # The cache object is built once per process; rebuild it for the new path.
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
