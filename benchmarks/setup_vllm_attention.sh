#!/usr/bin/env bash
# Set up the vLLM baseline of benchmarks/bench_attention.py in the git-ignored third_party/vllm_attention/:
# vLLM 0.33's attention ops from an unpacked wheel, plus the loader shim from ../shared/tools/vllm_attention.
#
#   VLLM_SRC=/path/to/dir-containing-vllm-package bash benchmarks/setup_vllm_attention.sh
#
# e.g.  pip download vllm==0.33.0 --no-deps --only-binary :all: -d /tmp/vllm_whl
#       mkdir /tmp/vllm_src && unzip -q /tmp/vllm_whl/vllm-*.whl 'vllm/v1/attention/ops/*' -d /tmp/vllm_src
# third_party/ is git-ignored: never commit what this script writes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DST="$ROOT/third_party/vllm_attention"
SRC="${VLLM_SRC:?set VLLM_SRC to a directory that contains the vllm/ package}"
SHIM="${VLLM_SHIM:-$ROOT/../shared/tools/vllm_attention/vllm_unified.py}"
[ -f "$SHIM" ] || SHIM=/work/shared/tools/vllm_attention/vllm_unified.py
OPS=vllm/v1/attention/ops
for f in "$OPS/triton_unified_attention.py" "$OPS/triton_attention_helpers.py" "$SHIM"; do
  case "$f" in /*) p="$f" ;; *) p="$SRC/$f" ;; esac
  [ -f "$p" ] || { echo "missing $p" >&2; exit 1; }
done
rm -rf "$DST"
mkdir -p "$DST/$OPS"
cp "$SRC/$OPS/"*.py "$DST/$OPS/"
cp "$SHIM" "$DST/vllm_unified.py"
echo "vLLM attention baseline in $DST"
