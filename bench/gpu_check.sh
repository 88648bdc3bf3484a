#!/usr/bin/env bash
# GPU readiness check for phalanx, for a machine with NVIDIA GPUs (about 5 minutes on one GPU).
#
#   bench/gpu_check.sh [DATA_FILE]        # default: Tiny Shakespeare next to the repo, else built-in text
#
# 1. environment: driver, torch's CUDA and NCCL, GPU count, native bf16
# 2. equivalence: tiny GPT-2, 10 steps; every GPU run must follow the CPU/Gloo 2-process DDP
#    trajectory (relative loss difference <= 1e-3: different GEMM kernels round differently; TF32 is
#    off for fp32 matmuls by default). With >= 2 GPUs also DDP and FSDP2 over NCCL.
# 3. contexts (>= 2 GPUs): while 2 workers train, each process holds a context on one GPU only
# 4. throughput: the benchmark model (examples/shakespeare.yaml shape): fp32 / bf16 / +compile on one
#    GPU, DDP vs FSDP2 and one vs two launchers with >= 2 GPUs; tokens/s and MFU
# 4b. big model: a ~1B Llama built the FSDP2 way on one GPU (bench/gpu_big_check.py): tokens/s, MFU, peak memory
#    against the memory plan, with/without activation checkpointing and with CPU offload; the sharded export
# Exit status: non-zero if any check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DATA=${1:-../shared/data/tinyshakespeare/input.txt}
WORK=$(mktemp -d -t phalanx-gpu-check-XXXXXX)
echo "== phalanx GPU check (work folder $WORK)"

if ! command -v nvidia-smi >/dev/null; then
  echo "gpu_check: nvidia-smi not found: this is not a GPU machine" >&2
  exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
NGPU=$($PY - <<'PYEOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: torch sees no GPU (a CPU-only torch build?)")
try:
    native = torch.cuda.is_bf16_supported(including_emulation=False)
except TypeError:
    native = torch.cuda.is_bf16_supported()
import sys
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} GPU(s), native bf16: {native}", file=sys.stderr)
print(torch.cuda.device_count())
PYEOF
)

status=0
echo "== equivalence"
$PY bench/strategies.py --check-equivalence --tolerance 1e-3 --data "$DATA" --work "$WORK/eq" || status=1
if [ "$NGPU" -ge 2 ]; then
  echo "== contexts"
  $PY bench/strategies.py --check-contexts --data "$DATA" --work "$WORK/ctx" || status=1
fi
echo "== big model (FSDP2 on a 1-device mesh, bf16 policy, activation checkpointing, CPU offload, sharded export)"
$PY bench/gpu_big_check.py || status=1
echo "== throughput"
$PY bench/strategies.py --device cuda --steps 60 --warmup 10 --data "$DATA" --work "$WORK/tp" || status=1
echo "== gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
