#!/usr/bin/env bash
# The GPU items of issues 14 and 15 in one device call, most valuable first; each section has
# its own time limit, so one that hangs or fails costs only its own time. Results go to $OUT
# (at most 8 files come back): env.txt, smoke.json, gemm.json, train.json, profile.json, log.txt.
#   OUT=/tmp/out bash tools/gpu_session.sh [eager|recheck|all]
# On a machine without this project's dependencies (the lent device's image has torch and
# transformers but not ortools), carry wheels and install them first, e.g. built here with
#   pip wheel --no-deps --no-build-isolation -w .whl .   (amp_rewrite, with its rule files)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl ortools immutabledict
# and there: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
set -u
MODE=${1:-all}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
# amp_rewrite from $PYTHONPATH where it is installed there (device: a carried wheel), else this checkout
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 AMP_REWRITE_FORK=0
exec > >(tee -a "$OUT/log.txt") 2>&1
section() {
  echo "=== $(date +%T) $1 (limit $2 s)"; shift
  timeout -s INT -k 10 "$@"; local rc=$?; echo "=== rc $rc"; return $rc
}
# BENCH_EXTRA='--device cpu --tiny' dry-runs the sections on a CPU
TRAIN="python3 -m amp_rewrite.bench gpu train --json $OUT/train.json ${BENCH_EXTRA:-}"
{ nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, onnx, onnx_ir, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'onnx_ir', onnx_ir.__version__, 'ortools', ortools.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# fail fast: a tiny model through every variant on CUDA
section "smoke" 90 $TRAIN --tiny --models gpt2 --compile off --steps 2 --warmup 1 \
    --json "$OUT/smoke.json" || exit 1
if [ ! -s "$OUT/smoke.json" ] || grep -q '"error"' "$OUT/smoke.json"; then
  echo "smoke test failed"; cat "$OUT/smoke.json"; exit 1
fi
# recheck: only what changed since the last measured run (the mask pass, compiled paths)
[ "$MODE" = recheck ] || section "gemm" 60 python3 -m amp_rewrite.bench gpu gemm --json "$OUT/gemm.json"
eager() {
  section "eager fp16 $1" 110 $TRAIN --models $1 --compile off --phases train forward \
      --steps 10 --warmup 3
}
compiled() {
  section "compiled fp16 $1" 150 $TRAIN --models $1 --compile on \
      --variants autocast amp_rewrite --steps 10 --warmup 3
}
eager bert
# where a BERT step's time goes (the attention kernel chosen, host vs device time)
section "profile bert" 60 python3 -m amp_rewrite.bench gpu profile --models bert \
    --variants autocast amp_rewrite --json "$OUT/profile.json"
eager gpt2
bf16() {
  section "eager bf16 bert gpt2" 120 $TRAIN --models bert gpt2 --dtype bf16 --compile off \
      --variants autocast amp_rewrite --steps 10 --warmup 3
}
if [ "$MODE" = recheck ]; then compiled bert; compiled gpt2; bf16; exit 0; fi
eager mlp_odd
[ "$MODE" = eager ] && { eager resnet50; exit 0; }
compiled bert; eager resnet50; compiled gpt2
bf16
