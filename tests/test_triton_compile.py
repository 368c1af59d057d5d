"""Every Triton kernel compiles to sm_90 machine code on a CPU machine, no GPU needed.

The interpreter runs kernels as Python and misses what only the compiler rejects (a
non-constexpr global, a shape tl.dot refuses, a register or shared-memory blow-up); this
compiles each kernel for an H100/H200 target with the configurations the adapters launch.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# find_spec, not import: importing triton here would fix its mode for this whole process
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install -e '.[triton]')")

ROOT = Path(__file__).resolve().parent.parent

COMPILE = r'''
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from conformance.backends.triton import (
    contiguous_kernel,
    merge_kernel,
    paged_kernel,
    splitkv_kernel,
)

TARGET = GPUTarget("cuda", 90, 32)
PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "float8_e4m3fn": "*fp8e4nv",
       "float8_e5m2": "*fp8e5"}
DOT = {"float16": tl.float16, "bfloat16": tl.bfloat16, "float32": tl.float32}


def build(fn, pointers, scalars, consts, **options):
    signature = {**pointers, **scalars, **{k: "constexpr" for k in consts}}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts)
    kernel = triton.compile(source, target=TARGET, options={"num_warps": 4, **options})
    assert "cubin" in kernel.asm, fn.__name__
    return kernel


dtype, head_dim, group, window = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
kv, kv_scale, q8, mods = sys.argv[5], int(sys.argv[6]), sys.argv[7], sys.argv[8] == "1"
query_tokens, draft_mask = int(sys.argv[9]), sys.argv[10] == "1"  # drafts (a power of two)
rows = max(16, query_tokens * triton.next_power_of_2(group))
t = PTR[dtype]
k, q = PTR[kv if kv != "same" else dtype], PTR[q8 if q8 != "none" else dtype]
block_d = max(16, triton.next_power_of_2(head_dim))
config = splitkv_kernel.tile_config(head_dim, kv != "same", rows)
flags = dict(KV_SCALE=kv_scale, Q_SCALED=q8 != "none")
# fp8 tiles as words of four codes where the adapter's launch reads them so (fp8_words)
words = config["fp8_words"] if dtype == "float16" and kv_scale == 1 else 0
modifiers = dict(HAS_CAP=mods, HAS_ALIBI=mods)


def build_splitkv(config, words):
    build(splitkv_kernel._splitkv_partial_kernel,
          {"q": q, "k_pages": k, "v_pages": k, "block_table": "*i32", "context_lens": "*i32",
           "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "k_scale": "*fp32",
           "v_scale": "*fp32", "q_scale": "*fp32", "alibi_slopes": "*fp32",
           "query_start": "*i32", "draft_mask": "*u8"},
          {"scale_log2": "fp32", "cap_log2": "fp32", "window": "i32", "sinks": "i32",
           "stride_table": "i32", "num_splits": "i32", "scale_stride": "i32",
           "mask_stride": "i32"},
          dict(NUM_KV_HEADS=2, GROUP=group, GROUP_P2=triton.next_power_of_2(group), ROWS=rows,
               QUERY_TOKENS=query_tokens, HAS_DRAFT_MASK=draft_mask,
               HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=16, BLOCK_N=config["BLOCK_N"],
               HAS_WINDOW=window, DOT_PRECISION="ieee" if dtype == "float32" else "tf32",
               DOT_DTYPE=DOT[dtype], FP8_WORDS=words, E5M2=kv == "float8_e5m2", **flags,
               **modifiers, LOOP_STAGES=config["loop_stages"],
               HEAD_MAJOR=config["head_major"]),
          num_stages=config["num_stages"], num_warps=config["num_warps"])


build_splitkv(config, words)
if words:  # what benchmarks/sweep_splitkv.py may launch besides: K and V as words, every
    # load in the loop pipelined, head-major pages
    build_splitkv({**config, "loop_stages": 3, "head_major": True, "num_warps": 2},
                  splitkv_kernel.WORDS_KV)
build(splitkv_kernel._combine_kernel,
      {"part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "out": t, "lse": "*fp32",
       "sink_logits": "*fp32"},
      {"rows": "i32", "num_splits": "i32", "num_heads": "i32"},
      dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=64, BLOCK_R=1,
           HAS_SINK=mods))
build(paged_kernel._paged_decode_kernel,
      {"q": q, "k_pages": k, "v_pages": k, "block_table": "*i32", "context_lens": "*i32",
       "out": t, "lse": "*fp32", "k_scale": "*fp32", "v_scale": "*fp32", "q_scale": "*fp32",
       "sink_logits": "*fp32", "alibi_slopes": "*fp32"},
      {"scale_log2": "fp32", "cap_log2": "fp32", "window": "i32", "sinks": "i32",
       "stride_table": "i32", "scale_stride": "i32"},
      dict(NUM_QO_HEADS=2 * group, NUM_KV_HEADS=2, GROUP=group, HEAD_DIM=head_dim,
           BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=16, BLOCK_P=16, BLOCK_H=1,
           HAS_WINDOW=window, HAS_SINK=mods, **flags, **modifiers))
if kv == "same" and q8 == "none":
    build(contiguous_kernel._contiguous_partial_kernel,
          {"q": t, "k_cache": t, "v_cache": t, "context_lens": "*i32", "part_m": "*fp32",
           "part_l": "*fp32", "part_acc": "*fp32"},
          {"scale_log2": "fp32", "window": "i32", "sinks": "i32", "max_len": "i32",
           "num_splits": "i32"},
          dict(NUM_QO_HEADS=2 * group, HEAD_DIM=head_dim,
               BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=contiguous_kernel.BLOCK_N,
               BLOCK_H=1, HAS_WINDOW=window))
    build(merge_kernel._merge_states_kernel,
          {"out_a": t, "lse_a": "*fp32", "out_b": t, "lse_b": "*fp32", "out": t, "lse": "*fp32"},
          {"rows": "i32"},
          dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_R=16))
print("compiled")
'''


# (dtype, head_dim, group, window, fp8 pages, KV_SCALE (1 per program, 2 per token),
#  fp8 query, soft-cap + ALiBi + sink logits, query tokens per sequence, draft mask)
@pytest.mark.parametrize("dtype,head_dim,group,window,kv,kv_scale,q8,mods,drafts,mask", [
    ("float16", 128, 4, "0", "same", 0, "none", "0", 1, "0"),
    ("bfloat16", 96, 71, "1", "same", 0, "none", "0", 1, "0"),
    ("float32", 256, 1, "1", "same", 0, "none", "0", 1, "0"),
    ("float16", 64, 8, "1", "same", 0, "none", "1", 1, "0"),
    ("float16", 128, 4, "0", "float8_e4m3fn", 1, "none", "0", 1, "0"),
    ("float16", 64, 8, "1", "float8_e5m2", 1, "float8_e4m3fn", "1", 1, "0"),
    ("bfloat16", 128, 8, "1", "float8_e5m2", 2, "float8_e4m3fn", "1", 1, "0"),
    ("float16", 128, 4, "1", "same", 0, "none", "1", 4, "0"),
    ("bfloat16", 128, 8, "1", "float8_e4m3fn", 1, "none", "0", 8, "1"),
])
def test_kernels_compile_for_sm90(dtype, head_dim, group, window, kv, kv_scale, q8, mods,
                                  drafts, mask):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", COMPILE, dtype, str(head_dim), str(group),
                             window, kv, str(kv_scale), q8, mods, str(drafts), mask],
                            cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


COMPILE_MLA = r'''
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from conformance.backends.triton import mla_kernel

rank, rope, heads, dtype, batch = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                   sys.argv[4], int(sys.argv[5]))
t = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype]
config = mla_kernel.tile_config(rank, heads, batch)
consts = dict(NUM_HEADS=heads, RANK=rank, ROPE=rope,
              BLOCK_C=max(16, triton.next_power_of_2(rank)),
              BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_H=config["BLOCK_H"],
              PAGE_SIZE=64, BLOCK_N=config["BLOCK_N"], HAS_WINDOW=True,
              DOT_PRECISION="ieee" if dtype == "float32" else "tf32",
              DOT_DTYPE={"float16": tl.float16, "bfloat16": tl.bfloat16,
                         "float32": tl.float32}[dtype])
signature = {"q": t, "pages": t, "block_table": "*i32", "context_lens": "*i32",
             "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "scale_log2": "fp32",
             "window": "i32", "sinks": "i32", "stride_table": "i32", "num_splits": "i32",
             **{k: "constexpr" for k in consts}}
source = triton.compiler.ASTSource(fn=mla_kernel._mla_partial_kernel, signature=signature,
                                   constexprs=consts)
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": config["num_warps"],
                                 "num_stages": config["num_stages"]})
assert "cubin" in kernel.asm
print("compiled")
'''


# (kv_lora_rank, rope_dim, heads, dtype, batch): DeepSeek-V3 at both tile configurations
# (16 heads a tile for one sequence, 64 heads and 8 warps for a batch), a small latent
@pytest.mark.parametrize("rank,rope,heads,dtype,batch", [
    (512, 64, 128, "bfloat16", 1), (512, 64, 128, "bfloat16", 32), (64, 16, 16, "float32", 1),
])
def test_the_mla_kernel_compiles_for_sm90(rank, rope, heads, dtype, batch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_MLA, str(rank), str(rope),
                             str(heads), dtype, str(batch)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
