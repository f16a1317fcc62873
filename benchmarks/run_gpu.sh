#!/usr/bin/env bash
# Everything a GPU session should run, from the repository root on the GPU machine (its own
# torch/triton/transformers; no package registry): the test suite, the tile tuner, then the GPU
# benchmarks. Figures go to stdout and to $OUT (or ./gpu-results) for docs/benchmarks.md.
#   bash benchmarks/run_gpu.sh                 # every part, in order
#   bash benchmarks/run_gpu.sh tests tune      # only the named parts (a device call is limited to 10 min)
# Parts: tests hot_path attention tune tp engine main profile_main. VLLM_SRC=<vllm wheel or dir> adds
# vLLM's Triton attention side by side (benchmarks/setup_vllm_attention.sh). Before the session, on the CPU
# machine: ../shared/tools/gpu/prepare, then benchmarks/prepare_gpu_extras.sh (wheels the prepare script
# lacks). A 10-minute call fits `tests` (~1.5 min on an H100 with 8 workers, then ~1.5 min for -m slow
# once SmolLM2 is installed) with `hot_path` and `engine`; see docs/gpu-runs/ for what each part printed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
out="${OUT:-gpu-results}"
mkdir -p "$out"

tests() {  # every failure, not the first only; the whole log kept
    python -m pytest -q -n 8 -p no:cacheprovider --timeout 300 tests > "$out/pytest.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.txt" | tail -40
}
hot_path() { python benchmarks/bench_hot_path.py --device cuda 2>&1 | tee "$out/hot_path.md"; }
attention() {
    [ -d third_party/vllm_attention ] || [ -z "${VLLM_SRC:-}" ] || bash benchmarks/setup_vllm_attention.sh
    python benchmarks/bench_attention.py 2>&1 | tee "$out/attention.md"  # with the tuned tiles when a table exists
}
tune() {
    python benchmarks/tune_attention.py --write 2>&1 | tee "$out/tune.md"  # writes kernels/configs/<gpu>.json
    cp kernels/configs/*.json "$out/" 2>/dev/null
}
tp() { python benchmarks/bench_tp.py 2>&1 | tee "$out/tp.md"; }
engine() { python benchmarks/bench_engine.py --device cuda 2>&1 | tee "$out/engine.md"; }
main() { python -m scheduler --device cuda --num-requests 16 --max-num-seqs 16 2>&1 | tail -30 | tee "$out/main_job.txt"; }
profile_main() { python benchmarks/profile_main_job.py --device cuda --rounds 3 2>&1 | tee "$out/profile_main_job.txt"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/machine.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/machine.txt"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests hot_path tune attention tp engine main)
for part in "${parts[@]}"; do
    case "$part" in
        tests|hot_path|attention|tune|tp|engine|main|profile_main) echo "## $part"; "$part" ;;
        *) echo "unknown part '$part'; choose from: tests hot_path attention tune tp engine main profile_main" >&2
           exit 2 ;;
    esac
done
