#!/usr/bin/env bash
# The one-call GPU check (issue 5): cuda-marked tests, pinned vs pageable H2D bandwidth, and a
# Qwen3-30B-A3B-shaped profile (random bf16 weights, 8 layers, --gpu-memory = two layers of experts,
# strategies none / router / oracle). Takes a few minutes on one GPU; needs ~25 GB of host RAM.
#
# Usage (repository root):  bash scripts/gpu_check.sh            # results in $OUT or profiles/
#                           LAYERS=12 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-profiles}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true

echo "== 1/2 cuda-marked tests"
timeout 240 python -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT_DIR/gpu-cuda-tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== 2/2 H2D bandwidth + Qwen3-30B-A3B-shaped profile"
timeout 420 python scripts/gpu_check.py --out-dir "$OUT_DIR" --layers "${LAYERS:-8}"
profile_rc=$?

echo "{\"cuda_tests_rc\": $tests_rc, \"profile_rc\": $profile_rc}"
exit $(( tests_rc != 0 || profile_rc != 0 ))
