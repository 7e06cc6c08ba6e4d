#!/bin/bash
# Device call 1 (2026-11-30): gpu-check on the sm_90 build made on the CPU
# machine, with batch-1 decode's norms and SwiGLU inside k_gemv and its
# kernels overlapping (programmatic dependent launch); then decode A/B in
# the same call: main's libkvcuda.so (8566225, KVW_CUDA_LIB) against the new
# one with both parts ("new": KVW_CUDA_PDL=1, which is off by default) and
# with each alone (KVW_CUDA_FUSE=rope turns the fusion off);
# an ncu kernel-time profile last. Carried: .gpucarry/ (build/gpu's bin and
# lib, main's library, the shared libraries kvworker needs), made on the CPU
# machine, in the repository's root:
#   make -j2 B=build/gpu CUDA=1 CUDA_GENCODE="-gencode arch=compute_90,code=sm_90" all
#   git worktree add /tmp/wt-main 8566225 && make -C /tmp/wt-main B=build/gpu CUDA=1 \
#       CUDA_GENCODE="-gencode arch=compute_90,code=sm_90" build/gpu/lib/libkvcuda.so
#   echo /.gpucarry/ >> .git/info/exclude
#   mkdir -p .gpucarry/gpu/bin .gpucarry/gpu/lib .gpucarry/lib .gpucarry/lib2
#   cp build/gpu/bin/{kvengine,kvworker,kvtiny-model} .gpucarry/gpu/bin/
#   cp build/gpu/lib/libkvcuda.so .gpucarry/gpu/lib/
#   cp /tmp/wt-main/build/gpu/lib/libkvcuda.so .gpucarry/gpu/lib/libkvcuda-main.so
#   for l in libjansson.so.4 libnats.so.3.4 libevent-2.1.so.7 libevent_core-2.1.so.7 \
#            libevent_pthreads-2.1.so.7 libprotobuf-c.so.1 libutf8proc.so.2 libxxhash.so.0; do
#       cp -L /lib/x86_64-linux-gnu/$l .gpucarry/lib/; done
#   cp -L /lib/x86_64-linux-gnu/{libssl,libcrypto}.so.3 .gpucarry/lib2/
# then: run(command="bash docs/data/h200-2026-11-30/call1-run.sh 2>&1",
#           carry=[".gpucarry"], timeout_s=560). About 12 MB travel.
set -u
T0=$(date +%s)
cd "$(dirname "$0")/../../.."
G=$PWD/.gpucarry
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/smi.txt
CUB=$(python3 -c 'import nvidia.cublas,os;print(os.path.join(list(nvidia.cublas.__path__)[0],"lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$G/lib:/usr/local/cuda/lib64:${CUB:-/nonexistent}
ldconfig -p | grep -q 'libssl.so.3 ' || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$G/lib2
export PYTHONUNBUFFERED=1
mkdir -p build && rm -rf build/gpu && cp -a $G/gpu build/gpu
ldd build/gpu/bin/kvworker build/gpu/bin/kvengine build/gpu/lib/libkvcuda.so | grep "not found"
log "gpu-check"
timeout 330 python3 tools/gpu-check --build build --no-build --out $OUT/gpu-check.json > $OUT/gpu-check.log 2>&1
log "gpu-check rc=$?"
python3 - $OUT/gpu-check.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("tests", r.get("tests")); print("correctness", {k: v.get("rel_err", v) for k, v in r.get("correctness", {}).items()})
print("b1", r.get("decode_tokens_per_s_batch1"), "b32", r.get("decode_tokens_per_s_batch32"), "share", r.get("decode_share_of_hbm_bound"), "prefill", r.get("prefill_tokens_per_s"))
for k, v in r.get("variants", {}).items(): print(k, v.get("decode_tokens_per_s", v))
PY
grep -E "FAILED|Error|rror:" $OUT/gpu-check.log | head -8
log "decode A/B"
B=build/gpu/bin/kvengine BIG=build/gpu/bench-models/llama-1b MAIN=$PWD/build/gpu/lib/libkvcuda-main.so
run() { local tag=$1; shift; echo "$tag :: $(env KVW_CUDA_DTYPE=bf16 "$@" 2>&1 | grep -E '^\{|rror' | head -2)"; }
NEW="env KVW_CUDA_PDL=1 $B"
{
for r in 1 2; do
  run main env KVW_CUDA_LIB=$MAIN $B bench --engine cuda --model $BIG --batch 1 --prompt 512 --gen 256
  run new $NEW bench --engine cuda --model $BIG --batch 1 --prompt 512 --gen 256
  if [ $r = 1 ]; then
    run new-fuse-only $B bench --engine cuda --model $BIG --batch 1 --prompt 512 --gen 256
    run new-pdl-only env KVW_CUDA_FUSE=rope KVW_CUDA_PDL=1 $B bench --engine cuda --model $BIG --batch 1 --prompt 512 --gen 256
    run new-neither env KVW_CUDA_FUSE=rope $B bench --engine cuda --model $BIG --batch 1 --prompt 512 --gen 256
  fi
done
for p in 2048 8192; do
  run main env KVW_CUDA_LIB=$MAIN $B bench --engine cuda --model $BIG --batch 1 --prompt $p --gen 128
  run new $NEW bench --engine cuda --model $BIG --batch 1 --prompt $p --gen 128
done
for b in 4 32; do
  run main env KVW_CUDA_LIB=$MAIN $B bench --engine cuda --model $BIG --batch $b --prompt 512 --gen 128
  run new $NEW bench --engine cuda --model $BIG --batch $b --prompt 512 --gen 128
done
} 2>&1 | tee $OUT/decode-ab.txt
log "ncu"
KVW_CUDA_DTYPE=bf16 KVW_CUDA_GRAPHS=0 KVW_CUDA_PDL=1 timeout 90 ncu --clock-control none --launch-skip 2000 --launch-count 300 \
  --metrics gpu__time_duration.sum --csv --page raw $B bench --engine cuda --model $BIG --batch 1 --prompt 64 --gen 64 > $OUT/ncu.csv 2> $OUT/ncu.err
log "ncu rc=$?"
log done
