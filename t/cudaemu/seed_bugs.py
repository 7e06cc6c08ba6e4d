#!/usr/bin/env python3
"""Seeds one bug at a time into a scratch copy of workers/cuda (docs/CUDA.md,
"Seeded bugs"), builds its libkvcuda-emu.so and test_kvemu, and runs
test_kvemu and the emulated engine tests on it (KVROUTE_CUDA_EMU_LIB).
Needs `make` first (build/obj/cuda-emu). Usage: t/cudaemu/seed_bugs.py [NAME...]
Not part of `make test` (minutes per bug)."""
import os, re, shutil, subprocess, sys, tempfile
WT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K = "workers/cuda/kvw_cuda_kernels.cuh"
C = "workers/cuda/kvw_cuda.cu"
S = "workers/cuda/kvw_cuda_sample.h"
BUGS = [
 ("merge", "split merge: the sums of exp merged without rescaling to the common max (k_attn_merge)", K,
  "        total += pp[(size_t) s * (hd + 2) + 1] * expf(pp[(size_t) s * (hd + 2)] - gmx);",
  "        total += pp[(size_t) s * (hd + 2) + 1];"),
 ("boundary", "split boundary off by one: a split that starts at the token's position is skipped (`start >= pos`, k_attn_split)", K,
  "    if (start > pos) return;            /* the whole block: before any barrier */",
  "    if (start >= pos) return;           /* the whole block: before any barrier */"),
 ("sync", "removed the __syncthreads() after q (and, fused, the token's K/V) is staged (k_attn_split)", K,
  """    }
    __syncthreads();
    for (int p = start + warp; p < end; p += KVC_ATT_WARPS) {""",
  """    }
    for (int p = start + warp; p < end; p += KVC_ATT_WARPS) {"""),
 ("gqa", "GQA group index: partials of query head kvh*G+g written to slot g*kv_heads+kvh (k_attn_split)", K,
  "        float *o = part + (((size_t) t * heads + kvh * G + g) * nsplit + split) * (hd + 2);",
  "        float *o = part + (((size_t) t * heads + g * kv_heads + kvh) * nsplit + split) * (hd + 2);"),
 ("cutoff", "device sampling: the merged candidates trusted past the first chunk cut-off (V = n, kvc_sample_pick)", S,
  "    if (cut_c >= 0) {\n        for (i = 0; i < n; i++) {",
  "    if (cut_c < -1) {\n        for (i = 0; i < n; i++) {"),
 ("graphkey", "CUDA graphs: the split-K grid left out of a graph's shape (replay)", C,
  "e->graphs[i].n_out == n_out && e->graphs[i].nsplit == nsplit) {",
  "e->graphs[i].n_out == n_out) {"),
 ("tc_ldm", "tensor-core prefill: K^T loaded with ldm 16 (the tile's width) instead of head_dim (k_attn_prefill_tc)", K,
  "                wmma::load_matrix_sync(fk, sk + d0, hd);",
  "                wmma::load_matrix_sync(fk, sk + d0, TT);"),
 ("tc_diag", "tensor-core prefill: no causal mask on P in the diagonal tile (keys past the row's position kept, k_attn_prefill_tc)", K,
  "                    float e = any && kb + c <= pos ? expf(ss[r * TT + c] - nmx) : 0.0f;",
  "                    float e = any ? expf(ss[r * TT + c] - nmx) : 0.0f;"),
 ("tc_rescale", "tensor-core prefill: a row's running sum not rescaled when its max grows (online softmax, k_attn_prefill_tc)", K,
  "                    s_sum[r] = s_sum[r] * corr + sum;",
  "                    s_sum[r] = s_sum[r] + sum;"),
 ("tc_sync", "tensor-core prefill: removed the __syncwarp() between the softmax lanes' writes and the rescale (k_attn_prefill_tc)", K,
  """                s_corr[r] = corr;
            }
            __syncwarp();""",
  """                s_corr[r] = corr;
            }"""),
 ("tc_runs", "tensor-core prefill: rows of an earlier sequence in the tile updated by the next one's keys (`r < r1`, k_attn_prefill_tc)", K,
  "int   r = lane, pos = s_pos[r], any = r >= r0 && r < r1 && kb <= pos;",
  "int   r = lane, pos = s_pos[r], any = r < r1 && kb <= pos;"),
 ("glu_swap", "k_gemv_glu: SiLU of up times gate instead of SiLU of gate times up", K,
  "((T *) act)[r] = from_f<T>(acc[0] / (1.0f + expf(-acc[0])) * accu[0]);",
  "((T *) act)[r] = from_f<T>(accu[0] / (1.0f + expf(-accu[0])) * acc[0]);"),
 ("norm_mean", "k_gemv_norm: the mean square over cols + 1 elements", K,
  "    inv = rsqrtf(ss / (float) cols + eps);",
  "    inv = rsqrtf(ss / (float) (cols + 1) + eps);"),
 ("norm_reload", "k_gemv_norm: a warp's later rows dotted with its first row's first weights (no reload)", K,
  "        if (r != r0) {\n            kvc_gemv_load(wp, wr, lane, np);",
  "        if (r < 0) {\n            kvc_gemv_load(wp, wr, lane, np);"),
 ("norm_sync", "k_gemv_norm: removed the __syncthreads() after the normed x is staged", K,
  "xt[i] = from_f<T>(in[i] * inv * nw[i]);\n    __syncthreads();\n",
  "xt[i] = from_f<T>(in[i] * inv * nw[i]);\n"),
 ("pdl_nowait", "k_attn_merge without kvc_pdl_wait (a PDL launch that would read the partials early)", K,
  "    kvc_pdl_wait();\n    kvc_pdl_trigger();\n    for (int s = 0; s < n; s++) gmx",
  "    kvc_pdl_trigger();\n    for (int s = 0; s < n; s++) gmx"),
]
only = sys.argv[1:]
SEL = {"gqa": "split_attention or (emu and matches_cpu and gqa)", "cutoff": "sampling_on", "graphkey": "graph_replay"}
for _b in ("tc_ldm", "tc_diag", "tc_rescale", "tc_sync", "tc_runs"):
    SEL[_b] = "tensor_core or (emu and half_weights)"
for _b in ("glu_swap", "norm_mean", "norm_reload", "norm_sync", "pdl_nowait"):
    SEL[_b] = "fused_norms or (emu and gemv)"
for name, what, f, a, b in BUGS:
    if only and name not in only:
        continue
    d = os.path.join(tempfile.gettempdir(), "kvroute-seed", name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    shutil.copytree(WT + "/workers/cuda", d + "/workers/cuda")
    p = d + "/" + f
    s = open(p).read()
    assert s.count(a) == 1, (name, a)
    open(p, "w").write(s.replace(a, b))
    san = "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined".split()
    base = ["g++", "-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
            "-Wno-unknown-pragmas"] + san
    lib = d + "/libkvcuda-emu.so"
    r1 = subprocess.run(base + ["-fPIC", "-shared", "-I" + d + "/workers/cuda/emu", "-I" + WT + "/src/core",
                                "-I" + WT + "/src/text", "-I" + WT + "/workers", "-o", lib, "-x", "c++",
                                d + "/" + C, d + "/workers/cuda/emu/kvemu.cpp", "-x", "none",
                                WT + "/build/obj/cuda-emu/kvw_model.o", WT + "/build/obj/cuda-emu/kvw_sample.o",
                                "-ljansson"], capture_output=True, text=True)
    r2 = subprocess.run(base + ["-I" + d + "/workers/cuda/emu", "-I" + d + "/workers/cuda", "-I" + WT + "/workers",
                                "-I" + WT + "/src/core", "-I" + WT + "/t/unit", "-o", d + "/test_kvemu", "-x", "c++",
                                WT + "/t/cudaemu/test_kvemu.cu", d + "/workers/cuda/emu/kvemu.cpp", "-x", "none",
                                WT + "/build/obj/cuda-emu/kvw_sample.o"], capture_output=True, text=True)
    if r1.returncode or r2.returncode:
        print(name, "BUILD FAILED", r1.stderr[-2000:], r2.stderr[-2000:], flush=True)
        continue
    u = subprocess.run([d + "/test_kvemu"], capture_output=True, text=True)
    unit_failed = re.findall(r"^not ok (\S+)", u.stdout, re.M)
    env = dict(os.environ, KVROUTE_CUDA_EMU_LIB=lib)
    t = subprocess.run([WT + "/.venv/bin/python", "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                        "t/integration/test_cuda_emu.py", "t/integration/test_cpu_engine.py", "-k",
                        SEL.get(name, "(split_attention or bf16_kv or graph_replay or fused or sampling_on) or (emu and (paging or matches_cpu))")],
                       capture_output=True, text=True, cwd=WT, env=env)
    failed = re.findall(r"^FAILED (\S+)", t.stdout, re.M)
    summ = t.stdout.strip().splitlines()[-1] if t.stdout.strip() else t.stderr[-300:]
    print("BUG", name, "|", what, flush=True)
    print("  unit failing:", unit_failed, flush=True)
    print("  pytest:", summ, flush=True)
    for x in failed:
        print("   ", x.split("::")[-1], flush=True)
