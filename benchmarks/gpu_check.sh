#!/usr/bin/env bash
# The CUDA checks, in one run of a few minutes on one GPU (issue 13's "On a GPU", issue 12's too):
#   1. every CUDA-marked test (tests/conftest.py: skip_if_no_cuda marks them `cuda`);
#   2. CUDA profiles of the bundled examples at the committed CPU profiles' batch (256 in 4
#      micro-batches), written to profiles/cuda/ (commit them from a GPU run);
#   3. the measured-vs-predicted table on CUDA (benchmarks/executor_vs_prediction.py);
#   4. a model larger than the GPU (a Llama-70B-shaped HF Llama, 280 GB of fp32 parameters, built
#      on meta) profiled layer by layer on CUDA, with its peak max_memory_allocated.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   (default: gpu_check/; everything is also printed)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check}"
mkdir -p "$out" profiles/cuda
python3 - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this script checks the CUDA paths"
print("torch", torch.__version__, "|", torch.cuda.get_device_name(0), "|",
      f"{torch.cuda.mem_get_info(0)[0] / 2**30:.1f} GiB free of {torch.cuda.mem_get_info(0)[1] / 2**30:.1f}",
      "|", torch.cuda.device_count(), "device(s)")
PY

echo "== 1. CUDA tests"
python3 -m pytest -q -p no:cacheprovider -m cuda -rs 2>&1 | tee "$out/cuda_tests.txt"

echo "== 2. CUDA profiles of the bundled examples"
for ex in mlp cnn gpt unet; do
  autopipe profile "$ex" --device cuda --batch-size 256 --chunks 4 --force --no-progress \
    --out "profiles/cuda/$ex.csv" | tail -n 3 | tee -a "$out/profiles.txt"
done

echo "== 3. measured vs predicted on CUDA"
python3 benchmarks/executor_vs_prediction.py --device cuda 2>&1 | tee "$out/prediction.txt"

echo "== 4. a model larger than the GPU, profiled layer by layer on CUDA"
python3 benchmarks/giant.py --device cuda --layers 80 --hidden 8192 --intermediate 28672 \
  --heads 64 --kv-heads 8 --stages 8 --threads 16 2>&1 | tee "$out/giant.txt"
