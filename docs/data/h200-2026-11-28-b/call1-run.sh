#!/bin/bash
# Device call 1 (main d3d915c plus the gpu-check change that writes the 1.2B
# model while the tests run): gpu-check on the sm_90 build made on the CPU
# machine, compute-sanitizer on the tiny model, an ncu kernel-time profile of
# batch-1 decode, and the copy bandwidth through PyTorch. Carried: .gpucarry/
# (build/gpu's bin and lib, the shared libraries kvworker needs).
set -u
T0=$(date +%s)
cd "$(dirname "$0")/.."
G=$PWD/.gpucarry
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/smi.txt
CUB=$(python3 -c 'import nvidia.cublas,os;print(os.path.join(list(nvidia.cublas.__path__)[0],"lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$G/lib:/usr/local/cuda/lib64:${CUB:-/nonexistent}
ldconfig -p | grep -q 'libssl.so.3 ' || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$G/lib2
export PYTHONUNBUFFERED=1
mkdir -p build && rm -rf build/gpu && cp -a $G/gpu build/gpu
log "gpu-check"
timeout 330 python3 tools/gpu-check --build build --no-build --out $OUT/gpu-check.json > $OUT/gpu-check.log 2>&1
TINY=build/gpu/gpu-check-tiny BIG=build/gpu/bench-models/llama-1b
TOK='[17,4,290,1000,5,5,77,31337,12,9,100,2,8,3000,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65,66,67]'
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 build/gpu/bin/kvengine logits --engine cuda --model $TINY --tokens "$TOK" --chunk 7 --batch 3 --decode 4 > $OUT/sanitizer.log 2>&1
timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 build/gpu/bin/kvengine logits --engine cuda --model $TINY --tokens "$TOK" --batch 2 --decode 3 >> $OUT/sanitizer.log 2>&1
KVW_CUDA_DTYPE=bf16 KVW_CUDA_GRAPHS=0 timeout 120 ncu --clock-control none --launch-skip 3000 --launch-count 450 \
  --metrics gpu__time_duration.sum --csv --page raw build/gpu/bin/kvengine bench --engine cuda --model $BIG --batch 1 --prompt 64 --gen 64 > $OUT/ncu.csv 2> $OUT/ncu.err
python3 - <<'PY'
import torch
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
for _ in range(10): y.copy_(x)
e.record(); torch.cuda.synchronize()
ms = s.elapsed_time(e) / 10
print("d2d copy: %.0f GB/s (read+write)" % (2 * x.numel() / ms / 1e6))
PY
