"""TVM's decode and merge kernels, compiled once per key, or loaded from an ahead-of-time build.

A key is (kernel, target, qo heads, kv heads, head dim, dtype, page size, sliding window,
and for MLA the rotary width):
each is compiled at most once per process. ``build`` exports every key a profile needs into
a directory; a machine with only TVM's runtime (no ``libtvm_compiler.so``) then loads them
from there. CUDA libraries hold CUDA source that TVM compiles when they are loaded; the
build also stores a fatbin per source, and the runtime's compile callback serves it, so the
GPU machine runs nvcc only for a source it has not seen.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

CUDA_ARCH = "sm_90"
AOT_ENV_NAME = "CONFORMANCE_TVM_AOT"


@dataclass(frozen=True)
class KernelKey:
    kernel: str  # "decode", "prefill" (several query tokens, causal), "tree" (a draft tree;
    # the CPU kernel reads pages of 16 only), "mla" (CUDA only) or "merge"
    target: str  # "llvm" or "cuda"
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int  # for MLA the latent's width (kv_lora_rank), the value's and the output's
    dtype: str
    page_size: int = 0
    sliding_window: bool = False
    rope_dim: int = 0  # MLA: the rotary key part after the latent

    @property
    def filename(self) -> str:
        return (f"{self.kernel}-{self.target}-q{self.num_qo_heads}kv{self.num_kv_heads}"
                f"-d{self.head_dim}{f'-r{self.rope_dim}' if self.rope_dim else ''}"
                f"-{self.dtype}-ps{self.page_size}{'-sw' if self.sliding_window else ''}.so")

    @classmethod
    def from_filename(cls, filename: str) -> KernelKey | None:
        match = _FILENAME.fullmatch(filename)
        if match is None:
            return None
        kernel, target, qo, kv, head_dim, rope, dtype, page_size, sliding = match.groups()
        return cls(kernel, target, int(qo), int(kv), int(head_dim), dtype, int(page_size),
                   bool(sliding), int(rope or 0))

    @property
    def instance(self) -> tuple[int, int, int, int, str]:
        """The (qo heads, kv heads, head_dim, page size, dtype) a case of this key has."""
        return (self.num_qo_heads, self.num_kv_heads, self.head_dim + self.rope_dim,
                self.page_size, self.dtype)

    @classmethod
    def for_case(cls, case, target: str) -> KernelKey:
        """The kernel that decodes ``case`` (one query token or several, GQA or MLA)."""
        sliding = case.window is not None
        if case.kind == "mla":
            return cls("mla", target, case.num_qo_heads, 1, case.kv_lora_rank, case.dtype,
                       case.page_size, sliding, case.rope_dim)
        kind = "decode" if case.query_lens is None else \
            "prefill" if case.mask == "causal" else "tree"
        return cls(kind, target, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                   case.dtype, case.page_size, sliding and kind == "decode")


_FILENAME = re.compile(r"(decode|prefill|tree|mla|merge)-(llvm|cuda)-q(\d+)kv(\d+)-d(\d+)"
                       r"(?:-r(\d+))?-(\w+)-ps(\d+)(-sw)?\.so")


def built_keys(aot_dir: Path) -> set[KernelKey]:
    """The kernels an ahead-of-time build holds, from its manifest (none without one)."""
    names = _manifest(aot_dir).get("keys", [])
    return {key for key in map(KernelKey.from_filename, names) if key is not None}


def build_failures(aot_dir: Path) -> dict[str, str]:
    """The kernels TVM could not build there, by file name, with TVM's error."""
    return _manifest(aot_dir).get("failures", {})


def _manifest(aot_dir: Path) -> dict:
    manifest = aot_dir / "manifest.json"
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


def has_compiler() -> bool:
    """Whether the installed tvm carries its compiler library (else: runtime only)."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "lib" / "libtvm_compiler.so").exists()


def import_tvm():
    """Import tvm, in runtime-only mode when its compiler library is absent."""
    if not has_compiler():
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import tvm

    return tvm


def cuda_target():
    tvm = import_tvm()
    return tvm.target.Target({"kind": "cuda", "arch": CUDA_ARCH, "max_num_threads": 1024,
                              "max_threads_per_block": 1024, "thread_warp_size": 32,
                              "max_shared_memory_per_block": 49152})


def prim_func(key: KernelKey):
    """TVM's own kernel for a key, from the installed package."""
    import_tvm()
    from tvm.relax.frontend.nn.llm import _decode_kernels as kernels
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    # the module, not the function of the same name the package exports
    tree_attn = importlib.import_module("tvm.relax.frontend.nn.llm.tree_attn")

    target = cuda_target() if key.target == "cuda" else None
    if key.kernel == "tree":
        if key.target == "llvm":
            return tree_attn.tree_attn_with_paged_kv_cache_cpu(
                key.num_kv_heads, key.num_qo_heads, key.head_dim, key.dtype, {})
        return tree_attn.tree_attn_with_paged_kv_cache(
            key.num_kv_heads, key.num_qo_heads, key.head_dim, key.dtype, {}, target)
    if key.kernel == "prefill":  # no sliding window: its size is compiled in (not claimed)
        if key.target == "llvm":
            return _prefill_kernels._attention_prefill_cpu(
                key.num_kv_heads, key.num_qo_heads, key.head_dim, key.dtype, False, {},
                key.page_size)
        return _prefill_kernels._attention_prefill(
            key.num_kv_heads, key.num_qo_heads, key.head_dim, key.dtype, False, {}, target,
            key.page_size)
    if key.kernel == "mla":  # one query token is a decode; no CPU variant exists
        if key.target == "llvm":
            raise ValueError("TVM 0.27 has no CPU MLA kernel (_attention_prefill_mla is CUDA)")
        return _prefill_kernels._attention_prefill_mla(
            key.num_qo_heads, key.head_dim, key.rope_dim, key.dtype, key.sliding_window, target,
            key.page_size)
    if key.kernel == "decode":
        if key.target == "llvm":
            return kernels._attention_decode_cpu(
                key.num_kv_heads, key.num_qo_heads, key.head_dim, key.dtype,
                key.sliding_window, {}, key.page_size)
        return kernels._attention_decode(
            key.num_kv_heads, key.num_qo_heads, key.head_dim, key.dtype, key.sliding_window, {},
            target, key.page_size)
    if key.target == "llvm":
        return kernels._merge_state_inplace_cpu(key.dtype)
    return kernels._merge_state_inplace(key.num_qo_heads, key.head_dim, key.dtype, target)


def entry_name(key: KernelKey) -> str:
    if key.kernel == "merge":
        return "merge_state_inplace_cpu" if key.target == "llvm" else "merge_state_inplace"
    if key.kernel == "prefill":
        return "batch_prefill_paged_kv_cpu" if key.target == "llvm" else "batch_prefill_paged_kv"
    if key.kernel == "tree":
        return "tree_attn_paged_kv_cpu" if key.target == "llvm" else "tree_attn_paged_kv"
    if key.kernel == "mla":
        name = "batch_prefill_paged_kv_mla"
    else:
        name = "batch_decode_paged_kv_cpu" if key.target == "llvm" else "batch_decode_paged_kv"
    return name + ("_sliding_window" if key.sliding_window else "")


def compile_kernel(key: KernelKey):
    """Compile a key with TVM's compiler; returns the executable (exportable) module."""
    tvm = import_tvm()
    target = cuda_target() if key.target == "cuda" else tvm.target.Target("llvm")
    return tvm.compile(tvm.IRModule({entry_name(key): prim_func(key)}), target=target)


def cuda_sources(executable) -> list[str]:
    return [m.inspect_source("cuda") for m in executable.mod.imports if m.kind == "cuda"]


def nvcc_fatbin(source: str) -> bytes:
    """CUDA source to an sm_90 fatbin with the nvcc on PATH."""
    arch = CUDA_ARCH.split("_")[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cu"
        path.write_text(source)
        subprocess.run(["nvcc", "--fatbin", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                        "-o", str(path.with_suffix(".fatbin")), str(path)], check=True,
                       capture_output=True, text=True)
        return path.with_suffix(".fatbin").read_bytes()


def source_digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:32]


class KernelCache:
    """Each key's callable, compiled or loaded once; counts compile and load time apart."""

    def __init__(self, target: str, aot_dir: Path | None = None):
        self.target = target
        self.aot_dir = aot_dir
        self.functions: dict[KernelKey, object] = {}
        self.compile_seconds = 0.0
        self.compiled = 0
        self.loaded = 0
        if target == "cuda":
            prepare_cuda_runtime(aot_dir)

    def get(self, key: KernelKey):
        if key not in self.functions:
            start = time.perf_counter()
            module = self._load(key)
            self.functions[key] = module[entry_name(key)]
            self.compile_seconds += time.perf_counter() - start
        return self.functions[key]

    def _load(self, key: KernelKey):
        tvm = import_tvm()
        if self.aot_dir is not None and (self.aot_dir / key.filename).exists():
            self.loaded += 1
            return tvm.runtime.load_module(str(self.aot_dir / key.filename))
        if self.aot_dir is not None:
            failures = build_failures(self.aot_dir)
            if key.filename in failures:
                raise RuntimeError(f"TVM could not build {key.filename}: "
                                   f"{failures[key.filename]}")
        if not has_compiler():
            where = self.aot_dir or f"no {AOT_ENV_NAME} directory"
            raise RuntimeError(f"TVM kernel {key.filename} is not in the ahead-of-time build "
                               f"({where}) and this tvm has no compiler")
        self.compiled += 1
        executable = compile_kernel(key)
        if key.target == "cuda":
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / key.filename
                executable.export_library(str(path))
                return tvm.runtime.load_module(str(path))
        return executable.mod


def build(keys: list[KernelKey], out: Path, fatbins: bool = True) -> dict:
    """Export every key into ``out`` (plus CUDA fatbins); returns a summary for the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "fatbin").mkdir(exist_ok=True)
    summary = {"keys": [], "failures": {}, "compile_seconds": 0.0, "nvcc_seconds": 0.0}
    for key in keys:
        start = time.perf_counter()
        try:
            executable = compile_kernel(key)
        except Exception as exc:  # TVM refuses some shapes: record it for the run to report
            summary["failures"][key.filename] = f"{type(exc).__name__}: {exc}"[:500]
            continue
        executable.export_library(str(out / key.filename))
        summary["compile_seconds"] += time.perf_counter() - start
        if key.target == "cuda" and fatbins:
            start = time.perf_counter()
            for source in cuda_sources(executable):
                target = out / "fatbin" / f"{source_digest(source)}.fatbin"
                if not target.exists():
                    target.write_bytes(nvcc_fatbin(source))
            summary["nvcc_seconds"] += time.perf_counter() - start
        summary["keys"].append(key.filename)
    (out / "manifest.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


_CUDA_READY = False


def prepare_cuda_runtime(aot_dir: Path | None) -> None:
    """Runtime-only TVM on a GPU: load the CUDA runtime library globally and register a
    compile callback (TVM's own needs the compiler library), serving prebuilt fatbins."""
    global _CUDA_READY
    if _CUDA_READY:
        return
    tvm = import_tvm()
    import tvm_ffi

    library = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    if library.exists():
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    fatbin_dir = aot_dir / "fatbin" if aot_dir else None

    def compile_cuda(source, *_):
        if fatbin_dir is not None:
            cached = fatbin_dir / f"{source_digest(source)}.fatbin"
            if cached.exists():
                return bytearray(cached.read_bytes())
        return bytearray(nvcc_fatbin(source))

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)
    _CUDA_READY = True


def keys_for_case(case, target: str, whole_instance: bool = False) -> set[KernelKey]:
    """Every kernel the checks ask for on a case: the case's decode with and without the
    window (merge segments have none), GQA repeated to MHA, the page size doubled (the
    page-size invariance), the drafts' kernel of several query tokens, and the merge.
    ``whole_instance``: what any case of the case's shape may ask (explore draws many cases
    of each shape it built): with the window whether or not the case has one, and both
    drafts' kernels (causal and tree) whether or not it has several query tokens."""
    keys = set()
    windows = {case.window is not None or whole_instance, False}
    merge = KernelKey("merge", target, case.num_qo_heads, case.num_qo_heads, case.head_dim_v,
                      case.dtype)
    if case.kind == "mla":  # one latent head: no GQA-as-MHA
        key = KernelKey.for_case(case, target)
        return {merge} | {replace(key, sliding_window=sliding, page_size=page_size)
                          for sliding in windows
                          for page_size in (case.page_size, case.page_size * 2)}
    drafts = ("prefill", "tree") if whole_instance else () if case.query_lens is None else (
        "prefill" if case.mask == "causal" else "tree",)
    for sliding in windows:
        for kv_heads in {case.num_kv_heads, case.num_qo_heads}:
            for page_size in (case.page_size, case.page_size * 2):
                keys.add(KernelKey("decode", target, case.num_qo_heads, kv_heads, case.head_dim,
                                   case.dtype, page_size, sliding))
                keys.update(KernelKey(kind, target, case.num_qo_heads, kv_heads, case.head_dim,
                                      case.dtype, page_size) for kind in drafts)
    keys.add(merge)
    return keys
