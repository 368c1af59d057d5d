#!/usr/bin/env bash
# What was run on the H200 (the device image: python3 3.12, torch, triton; no apache-tvm).
# Carried next to the repository: .whl/ (the apache-tvm-ffi wheel for cp312), .tvm-runtime/
# (the tvm package without libtvm_compiler.so) and .aot/ (python -m conformance build tvm
# --target cuda --profile full --out .aot, made on a CPU machine). Results go to $OUT.
#   bash benchmarks/gpu_session.sh conformance   # full profile, Triton and TVM CUDA backends
#   bash benchmarks/gpu_session.sh bench         # benchmarks of the GPU shapes
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
[[ -d .tvm-runtime ]] && export PYTHONPATH="$PWD/.tvm-runtime:${PYTHONPATH:-}"
[[ -d .aot ]] && export CONFORMANCE_TVM_AOT="$PWD/.aot"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

case "${1:-conformance}" in
  conformance)
    python3 -m conformance backends 2>&1 | grep -E "^[a-z]" | tee "$OUT/backends.txt"
    backends=()
    for name in ${BACKENDS:-tvm-cuda triton-splitkv triton-paged triton-contiguous}; do
      backends+=(--backend "$name")
    done
    timeout "${RUN_TIMEOUT:-420}" python3 -m conformance run --profile full -j 12 \
      "${backends[@]}" --report-json "$OUT/full-gpu.json" > "$OUT/full-gpu.log" 2>&1
    echo "run rc=$?"; grep -v "cases, " "$OUT/full-gpu.log" | head -40 | cut -c1-300
    ;;
  bench)
    timeout 300 python3 -m conformance bench --shapes gpu --rounds 5 --backend triton-splitkv \
      --backend triton-contiguous --backend tvm-cuda --report-json "$OUT/bench-gpu.json"
    timeout 200 python3 -m conformance bench --shapes gpu --rounds 1 --backend triton-paged \
      --report-json "$OUT/bench-gpu-paged.json"
    ;;
esac
