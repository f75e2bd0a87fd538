#!/usr/bin/env bash
# GPU benchmarks in one device call each, most valuable first; each section has its own time
# limit, so one that hangs or fails costs only its own time. Results go to $OUT (at most 8 files
# come back). Run it from the checkout's root.
#   OUT=/tmp/out bash tools/gpu_session.sh [all|rest|ort|ort2]
# all: a smoke test, the compile backend against compiled autocast in bf16 and fp16 (~10 min);
# rest (a second call on the warm machine): the backend with low outputs (bf16), fp16 with
# GradScaler, the hot T5 trained in mixed against autocast bf16, and a step profile.
#   BENCH_EXTRA='--device cpu --tiny' OUT=/tmp/out bash tools/gpu_session.sh   # CPU dry run
# ort: our ONNX output on onnxruntime's CUDA provider against FP32 and the peers
# (benchmarks/ort_latency.py): a smoke test, BERT-base and GPT-2 at 1x128 and 8x512, the
# Llama decode step with and without --low-io (~9 min, ort-cuda-*.json);
# ort2 (a second call on the warm machine): the Llama prefill, ViT-B/16, ResNet-50, the UNet
# stage, the Whisper decoder step, and ORT profiles of two models (~9 min).
#   ORT_EXTRA='--provider cpu --tiny --runs 3' OUT=/tmp/out bash tools/gpu_session.sh ort  # CPU
# The lent device's image has torch, transformers and lightning but not ortools (which
# amp_rewrite needs), torchao or onnxruntime-gpu. Carry the wheels of ortools (+ immutabledict)
# and torchao in .whl (see /work/.library/device/README.md); they are installed here.
# onnxruntime-gpu (~244 MiB) travels in 5 parts: `bash ../shared/device/ort-gpu-parts.sh` here
# makes .ortgpu/p1..p5 (~49 MiB each; a call carries at most 64 MiB), then, back to back on
# one machine (it goes back after 30 s idle):
#   calls 1-4: carry [".ortgpu/p1"] .. [".ortgpu/p4"], command `true`
#   call 5:    carry [".ortgpu/p5"], command `bash .ortgpu/p5/install.sh` (into /tmp/site)
#   call 6:    carry [".whl"], command `OUT=$OUT bash tools/gpu_session.sh ort`
#   call 7:    command `OUT=$OUT bash tools/gpu_session.sh ort2`
# (ort runs install.sh itself when onnxruntime has no CUDA provider yet and the parts are here.)
set -u
MODE=${1:-all}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || echo "the carried wheels did not install (another Python?)"
fi
# amp_rewrite itself, installed: its rule files ship as the package amp_rewrite.rules, which a
# source checkout on PYTHONPATH does not have; the benchmarks then run outside the checkout,
# with benchmarks/ and tests/models/ (not in the wheel) found through the checkout's root on
# PYTHONPATH after /tmp/site, so the installed amp_rewrite is the one imported
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
# ort, ort2: onnxruntime-gpu from the carried parts, unless an earlier call installed it
ORT_CUDA="import onnxruntime as o, sys
sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"
if [ "${MODE#ort}" != "$MODE" ] && [ -f .ortgpu/p5/install.sh ] \
    && ! PYTHONPATH=/tmp/site python3 -c "$ORT_CUDA" 2>/dev/null; then
  bash .ortgpu/p5/install.sh || echo "onnxruntime-gpu did not install from .ortgpu"
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 AMP_REWRITE_FORK=0
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) && cd "$(mktemp -d)" || exit 1
exec > >(tee -a "$OUT/log.txt") 2>&1
section() {
  echo "=== $(date +%T) $1 (limit $2 s)"; shift
  timeout -s INT -k 10 "$@"; local rc=$?; echo "=== rc $rc"; return $rc
}
EXTRA=${BENCH_EXTRA:-}
TRAIN="python3 -m benchmarks gpu train $EXTRA"
{ nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)"
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__,
      o.get_available_providers())"
  nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# ort, ort2: every variant in its own process (--variant-timeout kills a hung one); exports,
# conversions and FP32 outputs stay in /tmp/ort_latency for the next call on this machine
ORT="python3 -m benchmarks gpu ort --work-dir /tmp/ort_latency --variant-timeout 120"
ORT="$ORT ${ORT_EXTRA:-}"
if [ "$MODE" = ort ]; then
# fail fast: a tiny model on the CUDA provider (stops here when onnxruntime-gpu does not work)
section "ort smoke" 60 $ORT --tiny --models bert_base_1x128 --variants fp32 ours_fp16 --runs 5 \
    --json "$OUT/ort-cuda-smoke.json" || exit 1
section "ort text" 270 $ORT --models bert_base_1x128 bert_base_8x512 gpt2_1x128 gpt2_8x512 \
    --json "$OUT/ort-cuda-text.json"
section "ort llama decode" 200 $ORT --models llama_decode_past1024 llama_decode_past1024_lowio \
    --json "$OUT/ort-cuda-decode.json"
elif [ "$MODE" = ort2 ]; then
section "ort llama prefill" 120 $ORT --models llama_prefill_8x512 \
    --json "$OUT/ort-cuda-prefill.json"
section "ort vision" 200 $ORT --models vit_b16_32 resnet50_32 --json "$OUT/ort-cuda-vision.json"
section "ort unet whisper" 90 $ORT --models unet_block whisper_decoder_step \
    --json "$OUT/ort-cuda-small.json"
# where the time goes: Cast share, Memcpy nodes and nodes left on the CPU provider
section "ort profile" 120 $ORT --models bert_base_8x512 llama_decode_past1024 --runs 20 --profile \
    --variants fp32 ours_fp16 ort_opt_fp16 --json "$OUT/ort-cuda-profile.json"
elif [ "$MODE" = all ]; then
# fail fast: a tiny model through the backend
section "smoke" 60 $TRAIN --tiny --models gpt2 --variants autocast backend --compile on \
    --dtype bf16 --steps 2 --warmup 1 --json "$OUT/smoke.json"
# issue 27: the backend vs compiled autocast, every variant in its own process (the order of
# variants in one process decided the 2026-11-28 comparison; benchmarks §3.2)
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
# the hot-FFN T5 (tests/models/hot.py) in dtype="mixed" against autocast bf16, eager, 200 steps;
# autocast_fp16 for the steps its GradScaler skips (it overflows: its time is no comparison)
section "mixed t5_hot" 150 $TRAIN --models t5_hot --compile off --dtype mixed \
    --variants fp32 amp_rewrite autocast autocast_fp16 --steps 200 --warmup 10 \
    --json "$OUT/mixed_t5_hot.json"
section "profile llama" 120 python3 -m benchmarks gpu profile --models llama \
    --variants autocast backend --dtype bf16 --steps 3 --compile --json "$OUT/profile.json"
fi
