#!/usr/bin/env bash
# Issue 39 item 4 on a GPU machine: arm 11 (benchmarks.run --groups data) and
# the GPT arm (benchmarks.gpu), from the repo root:
#
#   bash benchmarks/device.sh            # carry .devwheels (clu, tensorboardX, ml_collections)
#
# Environment: PY (default python3), OUT (default /tmp/out: log.txt, data.json,
# gpu.json, gpu.md go there), QUICK=1 (tiny sizes, a CPU smoke run),
# GPT_FLAGS (extra flags for benchmarks.gpu, e.g. --fix-scale or --rounds 5),
# DATA_TIMEOUT / GPT_TIMEOUT (seconds per phase), SITE (where the wheels go).
# The wheels go to a --target folder on PYTHONPATH: the image is left unchanged.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/jl-site}
DATA_TIMEOUT=${DATA_TIMEOUT:-150}
GPT_TIMEOUT=${GPT_TIMEOUT:-240}
GPT_FLAGS=${GPT_FLAGS:-}
Q=""
[ "${QUICK:-0}" = 1 ] && Q="--quick"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

main() {
    local start=$SECONDS rc=0
    echo "== $(date -u +%FT%TZ) $(uname -m), $PY = $(command -v "$PY"), quick=${QUICK:-0}"
    if ls .devwheels/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --upgrade --target "$SITE" .devwheels/*.whl \
            || { echo "wheel install failed"; return 1; }
        export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "no .devwheels/*.whl: using $PY's own packages"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    "$PY" - <<'PYEOF' || { echo "import check failed"; return 1; }
import jax, flax, optax, torch, clu, tensorboardX
import jaxlightning
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "torch", torch.__version__, "clu", clu.__file__)
print("devices:", jax.devices())
PYEOF

    echo "== arm 11: benchmarks.run --groups data ($((SECONDS - start)) s in)"
    timeout -k 10 "$DATA_TIMEOUT" "$PY" -m benchmarks.run --groups data --out "$OUT/data.json" $Q \
        || { rc=$?; echo "arm 11 failed or timed out (rc $rc)"; }

    echo "== GPT: benchmarks.gpu ($((SECONDS - start)) s in)"
    # shellcheck disable=SC2086
    timeout -k 10 "$GPT_TIMEOUT" "$PY" -m benchmarks.gpu --data "$OUT/data.json" \
        --out "$OUT/gpu.json" $Q $GPT_FLAGS \
        || { rc=$?; echo "GPT arm failed or timed out (rc $rc)"; }
    echo "== done in $((SECONDS - start)) s, rc $rc"
    return $rc
}

main 2>&1 | tee "$OUT/log.txt"
