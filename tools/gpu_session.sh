#!/usr/bin/env bash
# The GPU items of issues 27 (compile backend vs compiled autocast) and 29 (FP8 GEMMs) in one
# device call, most valuable first; each section has its own time limit, so one that hangs or
# fails costs only its own time. Results go to $OUT (at most 8 files come back).
#   OUT=/tmp/out bash tools/gpu_session.sh [all|peers]
# peers: on a machine where our FP8 rows were just measured, only the peers' FP8 rows (same
# machine: comparable) and the backend sections.
#   BENCH_EXTRA='--device cpu --tiny' OUT=/tmp/out bash tools/gpu_session.sh   # CPU dry run
# The lent device's image has torch, transformers and lightning but not ortools or torchao:
# carry their wheels in .whl (see /work/.library/device/README.md); they are installed here.
set -u
MODE=${1:-all}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 AMP_REWRITE_FORK=0
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
if [ "$MODE" = peers ]; then
  section "backend bf16" 170 $TRAIN --models bert gpt2 llama resnet50 --compile on \
      --dtype bf16 --variants autocast backend --steps 10 --warmup 3 --json "$OUT/backend.json"
  section "fp8 peers" 120 $FP8 --models llama --variants bf16_rewrite autocast_bf16_compiled \
      torchao_tensorwise torchao_rowwise --steps 10 --warmup 3 --json "$OUT/fp8.json"
  exit 0
fi
# fail fast: tiny models through the backend and the FP8 rewrite
section "smoke" 60 $TRAIN --tiny --models gpt2 --variants autocast backend --compile on \
    --dtype bf16 --steps 2 --warmup 1 --json "$OUT/smoke.json"
section "smoke fp8" 60 $FP8 --tiny --models gpt2 --variants fp8_tensorwise --steps 2 \
    --warmup 1 --json "$OUT/smoke_fp8.json"
# which _scaled_mm dtype/scaling pairs this GPU runs, and the FP8 rewrite on a small MLP
[ -z "$EXTRA" ] && section "fp8 kernels" 60 python3 - <<'PY'
import torch
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 64, 32, 48
for ad in (E4, E5):
    for rw in (False, True):
        a = torch.randn(M, K, device="cuda").to(ad); b = torch.randn(N, K, device="cuda").to(E4)
        sa, sb = ((torch.rand(M, 1, device="cuda") + .5, torch.rand(1, N, device="cuda") + .5) if rw
                  else (torch.tensor(.5, device="cuda"), torch.tensor(2., device="cuda")))
        try:
            out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            ref = (a.float() * sa) @ (b.float().t() * sb)
            print("scaled_mm", ad, "rowwise" if rw else "tensorwise", "OK", (out.float() - ref).abs().max().item())
        except Exception as e:
            print("scaled_mm", ad, "rowwise" if rw else "tensorwise", "FAIL", str(e).splitlines()[0][:150])

import torch, amp_rewrite
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.GELU(), torch.nn.Linear(200, 64)).cuda()
x = torch.randn(4, 30, 100, device="cuda")
for scaling in ("tensorwise", "rowwise"):
    for gd in ("e5m2", "e4m3"):
        try:
            gm = amp_rewrite.rewrite(m, (x,), dtype=torch.bfloat16, fp8=scaling, fp8_min_size=0, fp8_grad_dtype=gd)
            y = gm(x); y.float().square().mean().backward()
            ref = m(x)
            print("rewrite", scaling, gd, gm.amp_report["fp8"]["counts"], "rel", ((y.float()-ref).norm()/ref.norm()).item(),
                  all(torch.isfinite(p.grad).all().item() for p in gm.parameters()))
        except Exception as e:
            print("rewrite", scaling, gd, "FAIL", type(e).__name__, str(e).splitlines()[0][:200])
PY
# issue 29: FP8 vs bf16 vs autocast vs torchao on the Llama shape and GPT-2 small
section "fp8" 180 $FP8 --steps 10 --warmup 3 --json "$OUT/fp8.json"
# issue 27: the backend vs compiled autocast, bf16 then fp16 (+ GradScaler / AmpOptimizer)
section "backend bf16" 170 $TRAIN --models bert gpt2 llama resnet50 --compile on --dtype bf16 \
    --variants autocast backend --steps 10 --warmup 3 --json "$OUT/backend.json"
section "backend fp16" 100 $TRAIN --models bert gpt2 llama resnet50 --compile on --dtype fp16 \
    --variants autocast backend backend_gradscaler --steps 10 --warmup 3 --json "$OUT/backend.json"
