"""Sharded loading and saving of weights across processes; run under the launcher.

    python -m jaxlightning.launch --nprocs 2 --devices-per-proc 4 \\
        tests/run_weights.py --file w.safetensors --out DIR

Each process builds the kernel ``(16, 64)`` of a Linear weight ``(64, 16)``
split over all 8 devices (columns), counting every block it reads from the
file, and writes ``DIR/rank<r>.json`` (the reads, and whether its shards hold
the file's values); process 0 then writes the array back with `save_weights`
to ``DIR/back.safetensors`` (gathered from both processes).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--file", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from jaxlightning.cluster.distributed import initialize

    initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxlightning as jl
    from jaxlightning.io.safetensors_format import SafetensorsFile
    from jaxlightning.io.weight_sources import open_source
    from tests.helpers import CountingSource

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P(None, "data"))
    into = {"kernel": jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=sharding)}
    source = CountingSource(open_source(args.file))
    out = jl.load_weights(source, into, rename=[("w", "kernel", "T")])
    expected = SafetensorsFile(args.file).read("w").T
    shards_match = all(
        np.array_equal(np.asarray(s.data), expected[s.index])
        for s in out["kernel"].addressable_shards
    )
    rank = jax.process_index()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "reads": source.reads,
                "shards_match": shards_match,
                "local_devices": jax.local_device_count(),
            },
            f,
        )
    jl.save_weights(out, os.path.join(args.out, "back.safetensors"), rename=[("w", "kernel", "T")])


if __name__ == "__main__":
    main()
