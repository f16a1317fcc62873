#!/usr/bin/env bash
# Everything a GPU session should run, in one command, from the repository root on the GPU machine
# (its own torch/triton/transformers; no package registry): the whole test suite, then the GPU
# benchmarks. Figures go to stdout and to $OUT (or ./gpu-results) for docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
out="${OUT:-gpu-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/machine.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/machine.txt"
python -m pytest -q -x tests 2>&1 | tail -25 | tee "$out/pytest.txt"
python benchmarks/bench_hot_path.py --device cuda 2>&1 | tee "$out/hot_path.md"
[ -d third_party/vllm_attention ] || [ -z "${VLLM_SRC:-}" ] || bash benchmarks/setup_vllm_attention.sh
python benchmarks/bench_attention.py 2>&1 | tee "$out/attention.md"
python benchmarks/bench_tp.py 2>&1 | tee "$out/tp.md"
python benchmarks/bench_engine.py --device cuda 2>&1 | tee "$out/engine.md"
python -m scheduler --device cuda --num-requests 16 --max-num-seqs 16 2>&1 | tail -30 | tee "$out/main_job.txt"
