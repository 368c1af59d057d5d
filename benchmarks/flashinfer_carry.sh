#!/usr/bin/env bash
# Build a FlashInfer bundle small enough to carry to the GPU machine (which has no registry).
#   bash benchmarks/flashinfer_carry.sh DIR     (run on the CPU machine, from the project root;
#                                                FLASHINFER_VERSION=0.6.13 for another release)
# Writes DIR/flashinfer.zip (about 24 MB: the Python package plus the headers its decode and
# cascade JIT modules need) and DIR/apache_tvm_ffi-*-cp312-*.whl. On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target SITE DIR/*.whl
#   python3 -c "import zipfile; zipfile.ZipFile('DIR/flashinfer.zip').extractall('SITE')"
#   export PYTHONPATH=SITE:$PYTHONPATH   (SITE: any empty folder)
# Kept: every .py, data/include, data/spdlog, the top-level files of data/csrc, and CCCL's cub,
# thrust and libcudacxx/include (the nvcc there bundles an older CCCL that lacks
# cuda::fast_mod_div). Dropped: data/cutlass and the sub-folders of data/csrc (other kernels).
set -euo pipefail
out=${1:?usage: flashinfer-carry DIR}
version=${FLASHINFER_VERSION:-0.7.2.post1}
tvm_ffi=${TVM_FFI_VERSION:-0.1.15.post2}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" "flashinfer-python==$version"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$out" "apache-tvm-ffi==$tvm_ffi"
python3 - "$work" "$out/flashinfer.zip" <<'PY'
import pathlib, sys, zipfile
work, target = pathlib.Path(sys.argv[1]), sys.argv[2]
wheel = next(work.glob("flashinfer_python-*.whl"))
keep_cccl = ("flashinfer/data/cccl/cub/", "flashinfer/data/cccl/thrust/",
             "flashinfer/data/cccl/libcudacxx/include/")
def keep(name: str) -> bool:
    if not name.startswith("flashinfer/"):
        return False
    if name.startswith("flashinfer/data/cutlass/"):
        return False
    if name.startswith("flashinfer/data/cccl/"):
        return name.startswith(keep_cccl)
    if name.startswith("flashinfer/data/csrc/"):
        return "/" not in name[len("flashinfer/data/csrc/"):]
    return True
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if keep(info.filename):
            dst.writestr(info, src.read(info))
print(f"wrote {target}")
PY
ls -la "$out"
