#!/usr/bin/env bash
# Copy vLLM v1's block pool into third_party/vllm_blockpool/ for the baseline
# column of benchmarks/bench_block_manager.py.
#
#   VLLM_SRC=/path/to/dir-containing-vllm-package bash benchmarks/setup_vllm_baseline.sh
#
# VLLM_SRC is a vLLM git checkout, or an unpacked wheel, e.g.:
#   pip download vllm --no-deps --only-binary :all: -d /tmp/vllm_whl
#   mkdir /tmp/vllm_src && unzip -q /tmp/vllm_whl/vllm-*.whl 'vllm/*' -d /tmp/vllm_src
#   VLLM_SRC=/tmp/vllm_src bash benchmarks/setup_vllm_baseline.sh
#
# Only four pure-Python files are copied verbatim; every other vLLM module they
# import (logger, envs, events, request, config, ...) is replaced by a small shim
# written below, so the baseline needs neither torch nor vLLM's dependencies.
# third_party/ is git-ignored: never commit what this script writes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DST="$ROOT/third_party/vllm_blockpool"
SRC="${VLLM_SRC:?set VLLM_SRC to a directory that contains the vllm/ package}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

COPIED=(
  vllm/v1/core/block_pool.py
  vllm/v1/core/kv_cache_utils.py
  vllm/utils/hashing.py
  vllm/utils/math_utils.py
)
for f in "${COPIED[@]}"; do
  [ -f "$SRC/$f" ] || { echo "missing $SRC/$f (is VLLM_SRC a vLLM checkout?)" >&2; exit 1; }
done

rm -rf "$DST"
for f in "${COPIED[@]}"; do
  mkdir -p "$DST/$(dirname "$f")"
  cp "$SRC/$f" "$DST/$f"
done

shim() {  # shim <relative path>: write stdin to it
  mkdir -p "$DST/$(dirname "$1")"
  cat > "$DST/$1"
}

for pkg in vllm vllm/utils vllm/v1 vllm/v1/core vllm/distributed vllm/multimodal; do
  shim "$pkg/__init__.py" < /dev/null
done

shim vllm/envs.py <<'EOF'
"""Shim: the only env flag the block pool reads."""
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False
EOF

shim vllm/logger.py <<'EOF'
"""Shim: standard-library logger."""
import logging


def init_logger(name):
    return logging.getLogger(name)
EOF

shim vllm/config/__init__.py <<'EOF'
"""Shim: type placeholders only."""


class VllmConfig:
    pass
EOF

shim vllm/distributed/kv_events.py <<'EOF'
"""Shim: KV events are disabled in the benchmark; these only need to exist."""
MEDIUM_GPU = "GPU"


class KVCacheEvent:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class AllBlocksCleared(KVCacheEvent):
    pass


class BlockRemoved(KVCacheEvent):
    pass


class BlockStored(KVCacheEvent):
    pass
EOF

shim vllm/multimodal/utils.py <<'EOF'
"""Shim: the benchmark has no multi-modal inputs."""


def get_mm_features_in_window(mm_features, start, end):
    raise NotImplementedError("multi-modal inputs are not part of the benchmark")
EOF

shim vllm/v1/core/kv_cache_metrics.py <<'EOF'
"""Shim: type placeholder (the benchmark passes no metrics collector)."""


class KVCacheMetricsCollector:
    pass
EOF

shim vllm/v1/kv_cache_interface.py <<'EOF'
"""Shim: type placeholders for the planning helpers the benchmark never calls."""


class KVCacheConfig: pass
class KVCacheGroupSpec: pass
class KVCacheSpec: pass
class MambaSpec(KVCacheSpec): pass
class UniformTypeKVCacheSpecs(KVCacheSpec): pass


def iter_layer_specs(*args, **kwargs):
    raise NotImplementedError
EOF

shim vllm/v1/kv_cache_spec_registry.py <<'EOF'
"""Shim: type placeholder."""


class KVCacheSpecRegistry:
    pass
EOF

shim vllm/v1/request.py <<'EOF'
"""Shim: type placeholder; the benchmark driver builds its own request objects."""


class Request:
    pass
EOF

shim vllm/v1/utils.py <<'EOF'
"""Shim: only used for prompt embeddings, which the benchmark has none of."""


def tensor_data(tensor):
    raise NotImplementedError
EOF

# hashing.py imports cbor2 at module level for sha256_cbor; the benchmark uses
# the default `sha256` (pickle), so a missing cbor2 gets a stub that fails on use.
if ! "$PY" -c "import cbor2" 2>/dev/null; then
  shim vllm_shims/cbor2.py <<'EOF'
"""Shim: cbor2 is not installed; sha256_cbor is unavailable."""


def dumps(*args, **kwargs):
    raise ModuleNotFoundError("cbor2 is not installed")
EOF
fi

VERSION="unknown"
if [ -f "$SRC/vllm/_version.py" ]; then
  VERSION="$("$PY" -c "import runpy,sys; g=runpy.run_path(sys.argv[1]); print(g.get('__version__','?'), g.get('__commit_id__') or '')" "$SRC/vllm/_version.py")"
elif git -C "$SRC" rev-parse HEAD >/dev/null 2>&1; then
  VERSION="git $(git -C "$SRC" rev-parse HEAD)"
fi
echo "$VERSION" > "$DST/VERSION"

cd "$DST" && PYTHONPATH="$DST:$DST/vllm_shims" "$PY" -c "
import vllm.v1.core.block_pool, vllm.v1.core.kv_cache_utils, vllm.utils.hashing
print('vLLM block pool baseline ready:', open('VERSION').read().strip())"
