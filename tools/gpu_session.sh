#!/usr/bin/env bash
# The GPU items of issues 27 (compile backend vs compiled autocast) and 29 (FP8 GEMMs) in one
# device call, most valuable first; each section has its own time limit, so one that hangs or
# fails costs only its own time. Results go to $OUT (at most 8 files come back).
#   OUT=/tmp/out bash tools/gpu_session.sh [all|rest]
# all: smoke tests, FP8 on the Llama shape with its peers, the backend in bf16 (~9 minutes);
# rest (a second call on the warm machine): the backend in fp16, FP8 row-wise and GPT-2;
# gpt2: only GPT-2 small under FP8 vs bf16 (fits the ~3 minutes left after 'all').
#   BENCH_EXTRA='--device cpu --tiny' OUT=/tmp/out bash tools/gpu_session.sh   # CPU dry run
# The lent device's image has torch, transformers and lightning but not ortools or torchao:
# carry their wheels in .whl (see /work/.library/device/README.md); they are installed here.
# Run it from the checkout's root.
set -u
MODE=${1:-all}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || echo "the carried wheels did not install (another Python?)"
fi
# amp_rewrite itself, installed: its rule files ship as the package amp_rewrite.rules, which a
# source checkout on PYTHONPATH does not have; the benchmarks then run outside the checkout
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 AMP_REWRITE_FORK=0
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) && cd "$(mktemp -d)" || exit 1
exec > >(tee -a "$OUT/log.txt") 2>&1
section() {
  echo "=== $(date +%T) $1 (limit $2 s)"; shift
  timeout -s INT -k 10 "$@"; local rc=$?; echo "=== rc $rc"; return $rc
}
EXTRA=${BENCH_EXTRA:-}
TRAIN="python3 -m amp_rewrite.bench gpu train $EXTRA"
FP8="python3 -m amp_rewrite.bench fp8 $EXTRA"
{ nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$MODE" = all ]; then
# fail fast: tiny models through the backend and the FP8 rewrite
section "smoke" 60 $TRAIN --tiny --models gpt2 --variants autocast backend --compile on \
    --dtype bf16 --steps 2 --warmup 1 --json "$OUT/smoke.json"
section "smoke fp8" 60 $FP8 --tiny --models gpt2 --variants fp8_tensorwise --steps 2 \
    --warmup 1 --json "$OUT/smoke_fp8.json"
# issue 29: FP8 vs bf16 vs autocast vs torchao on the Llama shape (each variant compiles for
# 40-50 s on an H100 host); issue 27: the backend vs compiled autocast (bf16)
section "fp8 llama" 280 $FP8 --models llama --variants bf16_rewrite fp8_tensorwise \
    autocast_bf16_compiled torchao_tensorwise torchao_rowwise --steps 10 --warmup 3 \
    --json "$OUT/fp8.json"
section "backend bf16" 170 $TRAIN --models bert gpt2 llama resnet50 --compile on --dtype bf16 \
    --variants autocast backend --steps 10 --warmup 3 --json "$OUT/backend.json"
elif [ "$MODE" = gpt2 ]; then  # a short second call: GPT-2 small must not slow down under FP8
section "fp8 gpt2" 170 $FP8 --models gpt2 --variants bf16_rewrite fp8_tensorwise \
    --steps 10 --warmup 3 --json "$OUT/fp8_gpt2.json"
else  # rest: a second call on the warm machine
section "backend fp16" 250 $TRAIN --models bert gpt2 llama resnet50 --compile on --dtype fp16 \
    --variants autocast backend backend_gradscaler --steps 10 --warmup 3 --json "$OUT/backend.json"
section "fp8 gpt2 rowwise" 250 $FP8 --models gpt2 llama --variants fp8_rowwise bf16_rewrite \
    --steps 10 --warmup 3 --json "$OUT/fp8_rest.json"
fi
