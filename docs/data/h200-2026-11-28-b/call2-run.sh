#!/bin/bash
# Device call 2: gpu-check on the sm_90 build made on the CPU machine,
# k_gemv's shapes against cuBLAS (tools/bench.d/gemv.cu), decode at
# batch 1/2/4 and longer contexts with the new paths on and off, and an
# ncu kernel-time profile of batch-1 decode.
set -u
T0=$(date +%s)
cd "$(dirname "$0")/.."
G=$PWD/.gpucarry
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
export LD_LIBRARY_PATH=$G/lib:/usr/local/cuda/lib64
ldconfig -p | grep -q 'libssl.so.3 ' || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$G/lib2
export PYTHONUNBUFFERED=1
mkdir -p build && rm -rf build/gpu && cp -a $G/gpu build/gpu
mkdir -p build/gpu/gemv-bench
SHAPES="8x8 4x8 8x4 8x16 16x8 4x16"
for s in $SHAPES; do
    nvcc -O3 -std=c++17 -arch=native -DKVC_GEMV_WARPS=${s%x*} -DKVC_GEMV_UNROLL=${s#*x} \
         -Iworkers/cuda -Iworkers -Isrc/core -o build/gpu/gemv-bench/gemv-$s tools/bench.d/gemv.cu -lcublas \
         > build/gpu/gemv-bench/cc-$s.log 2>&1 &
done
log "gpu-check"
timeout 360 python3 tools/gpu-check --build build --no-build --out $OUT/gpu-check.json > $OUT/gpu-check.log 2>&1
log "gpu-check rc=$?"
python3 - $OUT/gpu-check.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("tests", r["tests"]); print("correctness", {k: v.get("rel_err", v) for k, v in r["correctness"].items()})
print("b1 %.1f b32 %.1f share %.3f prefill %.0f" % (r["decode_tokens_per_s_batch1"], r["decode_tokens_per_s_batch32"], r["decode_share_of_hbm_bound"], r["prefill_tokens_per_s"]))
for k, v in r["variants"].items(): print(k, v.get("decode_tokens_per_s", v))
PY
grep -E "FAILED|Error" $OUT/gpu-check.log | head -5
wait
log "gemv bench"
for s in $SHAPES; do [ -x build/gpu/gemv-bench/gemv-$s ] && build/gpu/gemv-bench/gemv-$s || cat build/gpu/gemv-bench/cc-$s.log; done > $OUT/gemv.jsonl 2>&1
python3 - $OUT/gemv.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if l.startswith("{"):
        r = json.loads(l); print("%dx%-2d %-8s T%d gemv %7.1f us %5.0f GB/s  cublas %7.1f us %5.0f GB/s" % (r["warps"], r["unroll"], r["shape"], r["tokens"], r["gemv_us"], r["gemv_gbps"], r["cublas_us"], r["cublas_gbps"]))
    else: print(l.rstrip()[:200])
PY
log "decode runs"
B=build/gpu/bin/kvengine BIG=build/gpu/bench-models/llama-1b
run() { echo "$* :: $(env KVW_CUDA_DTYPE=bf16 "$@" 2>/dev/null | grep '^{')"; }
for b in 1 2 4 8; do
  run $B bench --engine cuda --model $BIG --batch $b --prompt 512 --gen 256
  run env KVW_CUDA_GEMV=0 $B bench --engine cuda --model $BIG --batch $b --prompt 512 --gen 256
done | tee $OUT/decode.txt
for p in 64 2048 8192; do
  run $B bench --engine cuda --model $BIG --batch 1 --prompt $p --gen 128
  run env KVW_CUDA_ATT_SPLIT=128 $B bench --engine cuda --model $BIG --batch 1 --prompt $p --gen 128
done | tee -a $OUT/decode.txt
run env KVW_CUDA_KV_DTYPE=bf16 $B bench --engine cuda --model $BIG --batch 1 --prompt 512 --gen 256 | tee -a $OUT/decode.txt
log "ncu"
KVW_CUDA_DTYPE=bf16 KVW_CUDA_GRAPHS=0 timeout 100 ncu --clock-control none --launch-skip 3000 --launch-count 450 \
  --metrics gpu__time_duration.sum --csv --page raw $B bench --engine cuda --model $BIG --batch 1 --prompt 64 --gen 64 > $OUT/ncu.csv 2> $OUT/ncu.err
log "ncu rc=$?"
log done
