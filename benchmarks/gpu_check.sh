#!/usr/bin/env bash
# The CUDA checks, in one run of under 10 minutes on one GPU, as the lent GPU machine is: its
# image's python3 (3.12, torch 2.11), the tree on PYTHONPATH (nothing installed), and what the
# image lacks (PuLP) carried as wheels in .whl/.
#   1. every CUDA-marked test (tests/conftest.py: skip_if_no_cuda marks them `cuda`);
#   2. CUDA profiles of the bundled examples at the committed CPU profiles' batch (256 in 4
#      micro-batches), written to $OUT/profiles/cuda/ (copy them to profiles/cuda/ to commit);
#   3. measured vs predicted on CUDA (benchmarks/executor_vs_prediction.py), at the CPU profiles'
#      batch and again at a batch large enough to keep the GPU busy (at 256 rows the bundled
#      examples are launch-bound on an H200: every kernel is shorter than launching it);
#   4. a Llama-70B-shaped HF Llama (280 GB of fp32 parameters, built on meta) profiled layer by
#      layer on CUDA, with its peak max_memory_allocated;
# then one table of the four (benchmarks/gpu_check_summary.py). Each step runs under its own
# `timeout`, so the whole stays within 10 minutes; every step's output is in ${OUT:-gpu_check}.
#
#   bash benchmarks/gpu_check.sh --wheels   # here, with pip: PuLP for Python 3.12 into .whl/
#   bash benchmarks/gpu_check.sh            # there: the checks (device tool: carry [".whl"])
#   bash benchmarks/gpu_check.sh --dry-run  # any machine, no CUDA: every import, command and flag
#                                           # of the real run, at a tiny size on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
case "$mode" in
  run | --dry-run) ;;
  --wheels)
    pulp="$(python3 -c 'import importlib.metadata as m; print(m.version("pulp"))' 2>/dev/null || echo 3.3.2)"
    exec python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "pulp==$pulp" ;;
  *) echo "gpu_check.sh: unknown argument '$mode'; use --dry-run, --wheels or none" >&2; exit 2 ;;
esac
out="${OUT:-gpu_check}"
mkdir -p "$out/profiles/cuda"
: >"$out/steps.tsv"
if compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || { echo "gpu_check.sh: the wheels in .whl/ did not install" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [[ "$mode" == --dry-run ]]; then
  device=cpu slack=6  # a shared CPU is slower than the GPU machine: each limit x6
  tests=(--collect-only)
  batch=8 repeats=1 warmup=1
  prediction=(--batch 8 --repeats 1 --rounds 1 --checkpoints except_last --threads 1)
  busy=(--models gpt --batch 8 --repeats 1 --rounds 1 --checkpoints except_last --threads 1)
  llama=(--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 256 --seq 16
         --batch 8 --chunks 8 --repeats 1 --stages 2 --threads 1)
else
  device=cuda slack=1
  tests=(-rs)
  batch=256 repeats=10 warmup=2
  prediction=(--batch 256 --repeats 10 --rounds 2)
  busy=(--models gpt cnn --batch 8192 --repeats 5 --rounds 1)
  llama=(--layers 80 --hidden 8192 --intermediate 28672 --heads 64 --kv-heads 8 --stages 8
         --threads 16)
fi

# step NAME SECONDS LOG COMMAND...: run COMMAND under `timeout`, its output printed and in LOG.
step() {
  local name="$1" limit="$2" log="$out/$3" start=$SECONDS rc
  shift 3
  echo "== $name"
  timeout --kill-after=10 "$((limit * slack))" "$@" 2>&1 | tee "$log"
  rc="${PIPESTATUS[0]}"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$log" >>"$out/steps.tsv"
}

step "torch and device" 30 device.txt python3 - "$mode" <<'PY'
import sys

import torch

import autopipe  # noqa: F401 - the tree on PYTHONPATH, with every dependency it imports
import pulp

print("torch", torch.__version__, "| python", sys.version.split()[0], "| pulp", pulp.__version__)
if sys.argv[1] == "--dry-run":
    print("dry run on the CPU: CUDA", "available" if torch.cuda.is_available() else "not needed")
else:
    assert torch.cuda.is_available(), "no CUDA device: this script checks the CUDA paths"
    free, total = torch.cuda.mem_get_info(0)
    print(torch.cuda.get_device_name(0), "|", f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f}",
          "|", torch.cuda.device_count(), "device(s)")
PY
# The files that hold CUDA tests (collecting the whole suite to select them costs ~20 s).
mapfile -t cuda_files < <(grep -rlE --include='test_*.py' 'skip_if_no_cuda|mark\.cuda' tests)
step "CUDA tests" 100 cuda_tests.txt \
  python3 -m pytest -q -p no:cacheprovider -m cuda "${tests[@]}" "${cuda_files[@]}"
for ex in mlp cnn gpt unet; do
  step "profile $ex" 25 "profile_$ex.txt" \
    python3 -m autopipe.app.cli profile "$ex" --device "$device" --batch-size "$batch" --chunks 4 \
    --repeats "$repeats" --warmup "$warmup" --force --no-progress --out "$out/profiles/cuda/$ex.csv"
done
step "measured vs predicted" 100 prediction.txt \
  python3 benchmarks/executor_vs_prediction.py --device "$device" "${prediction[@]}"
step "measured vs predicted, busy GPU" 100 prediction_busy.txt \
  python3 benchmarks/executor_vs_prediction.py --device "$device" "${busy[@]}"
step "Llama-70B shape, layer by layer" 120 giant.txt \
  python3 benchmarks/giant.py --device "$device" "${llama[@]}"

python3 benchmarks/gpu_check_summary.py "$out" "$mode" | tee "$out/summary.md"
exit "${PIPESTATUS[0]}"
