#!/usr/bin/env bash
# The GPU items of issue 27 (compile backend vs compiled autocast) in one device call, most
# valuable first; each section has its own time limit, so one that hangs or
# fails costs only its own time. Results go to $OUT (at most 8 files come back).
#   OUT=/tmp/out bash tools/gpu_session.sh [all|rest]
# all: a smoke test, the backend against compiled autocast in bf16 and fp16 (~10 minutes);
# rest (a second call on the warm machine): the backend with low outputs (bf16), fp16 with
# GradScaler, and a step profile.
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
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 AMP_REWRITE_FORK=0
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) && cd "$(mktemp -d)" || exit 1
exec > >(tee -a "$OUT/log.txt") 2>&1
section() {
  echo "=== $(date +%T) $1 (limit $2 s)"; shift
  timeout -s INT -k 10 "$@"; local rc=$?; echo "=== rc $rc"; return $rc
}
EXTRA=${BENCH_EXTRA:-}
TRAIN="python3 -m amp_rewrite.bench gpu train $EXTRA"
{ nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$MODE" = all ]; then
# fail fast: a tiny model through the backend
section "smoke" 60 $TRAIN --tiny --models gpt2 --variants autocast backend --compile on \
    --dtype bf16 --steps 2 --warmup 1 --json "$OUT/smoke.json"
# issue 27: the backend vs compiled autocast, every variant in its own process (the order of
# variants in one process decided the 2026-11-28 comparison; benchmarks §7c)
section "backend bf16" 300 $TRAIN --models llama gpt2 bert resnet50 --compile on --dtype bf16 \
    --variants backend autocast --steps 20 --warmup 5 --json "$OUT/backend_bf16.json"
section "backend fp16" 220 $TRAIN --models llama gpt2 bert resnet50 --compile on --dtype fp16 \
    --variants backend autocast --steps 20 --warmup 5 --json "$OUT/backend_fp16.json"
else  # rest: a second call on the warm machine
# the logits returned low as autocast returns them (keep_io_types=False): no fp32 copy of a
# batch x sequence x vocabulary tensor; compare with backend_bf16.json
section "backend low outputs bf16" 180 $TRAIN --models llama gpt2 bert resnet50 --compile on \
    --dtype bf16 --variants backend_low_io --steps 20 --warmup 5 --json "$OUT/low_io_bf16.json"
section "backend fp16 gradscaler" 180 $TRAIN --models llama gpt2 bert resnet50 --compile on \
    --dtype fp16 --variants backend_gradscaler --steps 20 --warmup 5 --json "$OUT/gradscaler.json"
section "profile llama" 120 python3 -m amp_rewrite.bench gpu profile --models llama \
    --variants autocast backend --dtype bf16 --steps 3 --compile --json "$OUT/profile.json"
fi
