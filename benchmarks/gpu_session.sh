#!/usr/bin/env bash
# What was run on the H200 (the device image: python3 3.12, torch, triton; no apache-tvm).
# For tvm-cuda, carry next to the repository: .whl/ (the apache-tvm-ffi wheel for cp312),
# .tvm-runtime/ (the tvm package without libtvm_compiler.so) and .aot/ (python -m conformance
# build tvm --target cuda --profile full --bench-shapes gpu --out .aot, made on a CPU machine).
# Results go to $OUT.
#   RUNS=3 bash benchmarks/gpu_session.sh conformance  # full profile (PROFILE), RUNS times
#        (BACKENDS, CHECKS (families), JOBS, SHARD=K/N, FILTER (space-separated: the ids
#        containing any of them; FILTER=fp8 for the fp8 families), CASE_TIMEOUT)
#   bash benchmarks/gpu_session.sh bench               # CLI bench (BENCH_BACKENDS), GPU shapes
#   bash benchmarks/gpu_session.sh pytest-bench        # pytest-benchmark: save, then gate
#   bash benchmarks/gpu_session.sh device-fault        # a Triton store out of bounds against
#        the same trigger raised in Python (tests/hostile_gpu.py): the same verdicts
#   bash benchmarks/gpu_session.sh index-widths        # issue 17: the planted int32 flat offset
#        on the full large-offset case (2^31 elements), that case's oracle on the GPU backends
#        (BACKENDS); PART=2: the ci cases of index widths and very negative scores on them
#   bash benchmarks/gpu_session.sh upgrade             # the FlashInfer upgrade gate: PROFILE on
#        the release in .flashinfer-old/ (FLASHINFER_VERSION=0.6.13 bash
#        benchmarks/flashinfer_carry.sh .flashinfer-old), then on .flashinfer/, then compare
#   bash benchmarks/gpu_session.sh fp8                 # issue 18: the ci and full fp8 families
#        on every fp8 backend, the gpu bench shapes with fp16 and e4m3 caches in one run;
#        carry .flashinfer/
#   bash benchmarks/gpu_session.sh fp8-speed           # issue 18: the fp8 launch sweep (with the
#        ways of reading fp8 tiles), and the gpu bench shapes (fp16 and e4m3) on FP8_BENCH
#        (default triton-splitkv flashinfer flashinfer-tc; empty: the sweep only)
#   bash benchmarks/gpu_session.sh modifiers           # issue 19: the soft-cap, sink-logit,
#        ALiBi and served-model families (ci, then the full served models) on the GPU
#        backends, and the FlashInfer reproducers in docs/findings/
#   bash benchmarks/gpu_session.sh multi-token         # issue 20: the ci multi-token cases on
#        the GPU backends that claim them, reproducers (PROBES), the gpu bench shapes with 4
#        query tokens and 1 on triton-splitkv and FlashInfer; carry .flashinfer/
#   bash benchmarks/gpu_session.sh mla                 # issue 21: the MLA families (ci, then
#        DeepSeek's long contexts) on triton-mla, flashinfer-mla, torch-flex, tvm-cuda; the MLA
#        bench shapes on triton-mla, flashinfer-mla and tvm-cuda in one run; carry .flashinfer/
#        and, for tvm-cuda, .tvm-runtime/ and .aot/ holding the MLA kernels
#   bash benchmarks/gpu_session.sh explore-variants    # explore --fp8 on the fp8 backends and
#        explore (which draws the modifiers where claimed) on the modifier ones, side by side
#   bash benchmarks/gpu_session.sh speed               # issue 22: SPEED_BACKEND's ci cold and
#        warm (-j JOBS (16), then half), numpy's ci, then SPEED_BACKEND's full warm (cut at
#        FULL_TIMEOUT; 0: not run), -j JOBS; BASELINE=DIR (an older checkout): its ci and this
#        tree on that spec, warm, alternating, ROUNDS times, first; HALF_JOBS=0: no half-jobs run;
#        whether Python keeps the libraries' bytecode there (python-bytecode.txt)
#   bash benchmarks/gpu_session.sh speed-full          # issue 22: SPEED_BACKEND's full, -j JOBS,
#        ROUNDS times (FULL_TIMEOUT each; TREES="DIR ... .": older checkouts and this one in
#        turn each round; PROFILES="ci full": each profile in turn), then PROFILE_CASES (ids)
#        alone, profiled
#   bash benchmarks/gpu_session.sh speed-threads       # issue 22: THREAD_FILTER's full cases with
#        the libraries' default threads and one a process, alternating; PROFILE_CASES alone
#   bash benchmarks/gpu_session.sh same-reports        # issue 22: SAME_FILTER's full cases on
#        SPEED_BACKEND with -j JOBS, -j 1 and --in-process: the reports' results must agree
#        (they once depended on the core count through OpenBLAS's threads)
#   bash benchmarks/gpu_session.sh upload-rate         # issue 22: a pool of UPLOAD_GB to the GPU,
#        pageable (.to) against the adapters' pinned chunks (backends/tensors.py), ROUNDS times
#   bash benchmarks/gpu_session.sh speed-fork          # issue 22: SPEED_BACKEND's ci (and full
#        unless FULL=0) with every worker spawned (CONFORMANCE_FORK=0) and forked from its
#        zygote, in turn, ROUNDS times after a cold ci; then benchmarks/worker_start.py
#        (spawned, forked, each with and without the early CUDA context); EARLY="1 0": the
#        runs with the Triton backends' early CUDA context and key (runtime.start_early) and
#        without, in turn
#   bash benchmarks/gpu_session.sh speed-profile       # issue 22: SPEED_BACKEND's ci cold,
#        warm, then warm with every process profiled (profile-report-*.txt, profile.tar.gz)
# For flashinfer and flashinfer-tc carry .flashinfer/ (benchmarks/flashinfer_carry.sh).
#   bash benchmarks/gpu_session.sh explore             # explore each of EXPLORE_BACKENDS for
#        EXPLORE_SECONDS, side by side, spread over the GPUs (tvm-cuda from .aot-explore/:
#        python -m conformance build tvm --target cuda --explore 30 --out .aot-explore)
# Folders too large to carry as they are can travel as .gpu-carry/NAME.tar.gz (unpacked here).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: runs of an older checkout cd there
export PYTHONUNBUFFERED=1
# The carried folders are unpacked and installed once for what was carried: sessions started
# side by side (one per job) wait on the lock rather than unpack over each other's imports.
carried=$(ls -l --time-style=+%s .gpu-carry .whl .flashinfer 2>/dev/null | md5sum)
(
  flock 9
  [[ $(cat /tmp/gpu-session.ready 2>/dev/null) == "$carried" ]] && exit 0
  for packed in .gpu-carry/*.tar.gz; do
    [[ -e $packed ]] && tar -xzf "$packed"
  done
  [[ -d .whl ]] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  # FlashInfer: benchmarks/flashinfer_carry.sh .flashinfer (made on a CPU machine), carried
  if [[ -d .flashinfer ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/flashinfer .flashinfer/*.whl
    python3 -c "import zipfile; zipfile.ZipFile('.flashinfer/flashinfer.zip').extractall('/tmp/flashinfer')"
  fi
  echo "$carried" > /tmp/gpu-session.ready
) 9> /tmp/gpu-session.lock
[[ -d .whl ]] && export PYTHONPATH=/tmp/site
[[ -d .flashinfer ]] && export PYTHONPATH="/tmp/flashinfer:${PYTHONPATH:-}"
[[ -d .tvm-runtime ]] && export PYTHONPATH="$PWD/.tvm-runtime:${PYTHONPATH:-}"
[[ -d .aot ]] && export CONFORMANCE_TVM_AOT="$PWD/.aot"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

cpu_ticks() {  # the machine's busy and idle clock ticks so far (/proc/stat, USER_HZ)
  awk '/^cpu /{print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat
}

timed() {  # NAME TIMEOUT ARGS...: one run (-j $jobs), its wall time, exit status and the
  # machine's CPU use over it (busy core-seconds, and the share of all cores) in runs.txt
  local name=$1 limit=$2 start rc ticks; shift 2
  start=$(date +%s.%N)
  ticks=$(cpu_ticks)
  if [[ -n ${TREE:-} ]]; then  # an older checkout, importing its own package (no --durations)
    (cd "$TREE" && PYTHONPATH="$PWD:$PYTHONPATH" timeout "$limit" python3 -m conformance run \
      -j "$jobs" --report-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1)
  else
    timeout "$limit" python3 -m conformance run -j "$jobs" --durations 12 \
      --report-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  fi
  rc=$?
  echo "$name rc=$rc $(python3 -c "import time; print(round(time.time() - $start, 1))") s," \
    "$(echo "$ticks $(cpu_ticks)" | awk '{busy = ($3 - $1) / 100; idle = ($4 - $2) / 100;
      printf "cpu %.1f core-s busy, %.0f%% of the cores", busy, 100 * busy / (busy + idle)}')" \
    | tee -a "$OUT/runs.txt"
  tail -16 "$OUT/$name.log" >> "$OUT/runs.txt"
  gzip -f "$OUT/$name.json" 2>/dev/null
}

case "${1:-conformance}" in
  conformance)
    { nvidia-smi -L || echo "no nvidia-smi"; } | tee "$OUT/backends.txt"
    python3 -m conformance backends 2>&1 | grep -E "^[a-z]" | tee -a "$OUT/backends.txt"
    checks=(); for family in ${CHECKS:-}; do checks+=(--check "$family"); done
    backends=()
    for name in ${BACKENDS:-tvm-cuda triton-splitkv triton-paged triton-contiguous}; do
      backends+=(--backend "$name")
    done
    # Which GPU each worker process uses, sampled while the runs go (one worker per GPU).
    while sleep 5; do
      nvidia-smi --query-compute-apps=timestamp,gpu_uuid,pid --format=csv,noheader
    done > "$OUT/gpu-apps.csv" 2>/dev/null &
    sampler=$!
    deadline=$(( $(date +%s) + ${TOTAL_TIMEOUT:-100000} ))  # keep inside a device call's limit
    for run in $(seq "${RUNS:-1}"); do
      limit=$(( deadline - $(date +%s) ))
      (( limit > ${RUN_TIMEOUT:-420} )) && limit=${RUN_TIMEOUT:-420}
      (( limit < 30 )) && { echo "run $run not started: no time left" | tee -a "$OUT/runs.txt"; break; }
      accuracy=(--save-accuracy "$OUT/accuracy-1.json")
      [[ $run -gt 1 ]] && accuracy=(--compare-accuracy "$OUT/accuracy-1.json")
      start=$(date +%s)
      shard=(); [[ -n ${SHARD:-} ]] && shard=(--shard "$SHARD")
      # FILTER: the cases whose ids contain any of its words (-k alone narrows by all)
      for pattern in ${FILTER:-}; do
        python3 -m conformance list --profile "${PROFILE:-full}" -k "$pattern"
      done | sort -u > "$OUT/cases.txt"
      [[ -n ${FILTER:-} ]] && while read -r id; do shard+=(--case "$id"); done < "$OUT/cases.txt"
      timeout "$limit" python3 -m conformance run --profile "${PROFILE:-full}" -j "${JOBS:-12}" \
        --case-timeout "${CASE_TIMEOUT:-300}" "${backends[@]}" "${checks[@]}" "${shard[@]}" "${accuracy[@]}" --report-json "$OUT/full-gpu-$run.json" \
        --summary-md "$OUT/summary-$run.md" > "$OUT/full-gpu-$run.log" 2>&1
      rc=$?
      echo "run $run rc=$rc $(( $(date +%s) - start )) s" | tee -a "$OUT/runs.txt"
      grep -v "cases, " "$OUT/full-gpu-$run.log" | tail -25 | cut -c1-300
      { echo "## run $run (rc=$rc)"; cat "$OUT/summary-$run.md"; grep -v "cases, " "$OUT/full-gpu-$run.log"; } \
        >> "$OUT/runs.txt" 2>/dev/null
      rm -f "$OUT/summary-$run.md" "$OUT/full-gpu-$run.log"
      gzip -f "$OUT/full-gpu-$run.json" 2>/dev/null
    done
    kill "$sampler"
    gzip -f "$OUT/accuracy-1.json" 2>/dev/null
    ;;
  bench)
    backends=()
    for name in ${BENCH_BACKENDS:-triton-splitkv triton-contiguous triton-paged tvm-cuda}; do
      backends+=(--backend "$name")
    done
    timeout "${BENCH_TIMEOUT:-400}" python3 -m conformance bench --shapes gpu \
      --rounds "${ROUNDS:-5}" "${backends[@]}" --report-json "$OUT/bench-gpu.json"
    ;;
  upgrade)
    # two FlashInfer releases, one profile, one comparison: what the upgrade changes
    for release in old new; do
      folder=.flashinfer; [[ $release == old ]] && folder=.flashinfer-old
      rm -rf "/tmp/flashinfer-$release"
      python3 -m pip install -q --no-index --no-deps --target "/tmp/flashinfer-$release" "$folder"/*.whl
      python3 -c "import zipfile; zipfile.ZipFile('$folder/flashinfer.zip').extractall('/tmp/flashinfer-$release')"
      PYTHONPATH="/tmp/flashinfer-$release:$PWD" timeout "${RUN_TIMEOUT:-240}" python3 -m conformance run \
        --profile "${PROFILE:-ci}" -j "${JOBS:-12}" --backend flashinfer --backend flashinfer-tc \
        --report-json "$OUT/flashinfer-$release.json" > "$OUT/flashinfer-$release.log" 2>&1
      echo "$release rc=$?"
    done
    python3 -m conformance compare "$OUT/flashinfer-old.json" "$OUT/flashinfer-new.json" | tee "$OUT/upgrade.txt"
    gzip -f "$OUT"/flashinfer-*.json
    ;;
  fp8)
    fp8_backends="triton-splitkv triton-paged flashinfer flashinfer-tc"
    ( OUT=$OUT/ci PROFILE=ci FILTER=fp8 BACKENDS="$fp8_backends torch-flex torch-sdpa" \
      JOBS=14 RUN_TIMEOUT=${RUN_TIMEOUT:-240} bash "$0" conformance )
    ( OUT=$OUT/full PROFILE=full FILTER=fp8-model BACKENDS="$fp8_backends" JOBS=8 \
      RUN_TIMEOUT=${RUN_TIMEOUT:-120} bash "$0" conformance )
    ( OUT=$OUT/bench BENCH_BACKENDS="triton-splitkv flashinfer flashinfer-tc" ROUNDS=3 \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-170} bash "$0" bench )
    ;;
  fp8-speed)
    fp8_bench=${FP8_BENCH-triton-splitkv flashinfer flashinfer-tc}
    # FlashInfer JIT-compiles its bench modules (fp16 and e4m3, both paths, groups 4 and 8)
    # on small problems while the sweep runs, so that its bench times kernels, not nvcc
    [[ $fp8_bench == *flashinfer* ]] && timeout 300 python3 - > "$OUT/flashinfer-warm.log" 2>&1 <<'PY' &
from conformance.backends.registry import resolve
from conformance.materialise import materialise
from conformance.problem import poisoned_outputs
from conformance.spec import Case
for name in ("flashinfer", "flashinfer-tc"):
    backend = resolve(name)()
    for hq, hkv in ((32, 8), (16, 2)):
        for kv in (None, "float8_e4m3fn"):
            problem = materialise(Case("warm", hq, hkv, 128, 16, "float16", (64,), kv_dtype=kv))
            out, lse = poisoned_outputs(problem, 0.0)
            backend.decode(problem, out, lse)
            print(name, hq, hkv, kv, "compiled", flush=True)
PY
    warm=$!
    timeout "${SWEEP_TIMEOUT:-200}" python3 benchmarks/sweep_splitkv.py --fp8 \
      --out "$OUT/sweep-fp8.json" 2>&1 | tail -8
    echo "sweep rc=$?"
    wait "$warm"; echo "flashinfer warm-up rc=$?"; tail -3 "$OUT/flashinfer-warm.log"
    mkdir -p "$OUT/bench"
    for name in $fp8_bench; do
      timeout "${BENCH_TIMEOUT:-110}" python3 -m conformance bench --shapes gpu --rounds 2 \
        --backend "$name" --report-json "$OUT/bench/$name.json" 2>&1 | tail -16
    done
    ;;
  modifiers)
    gpu_backends="triton-splitkv triton-paged torch-flex torch-sdpa flashinfer flashinfer-tc"
    for probe in docs/findings/flashinfer_decode_sinks_ignored.py \
                 docs/findings/flashinfer_alibi_softcap_scale_twice.py; do
      echo "== $probe"; timeout 120 python3 "$probe" 2>&1 | tail -8
    done | tee "$OUT/reproducers.txt"
    ( OUT=$OUT/ci PROFILE=ci FILTER="soft-cap sink-logits alibi modifiers-combined served-models" \
      BACKENDS="$gpu_backends" JOBS=14 RUN_TIMEOUT=${RUN_TIMEOUT:-220} bash "$0" conformance )
    [[ ${SERVED_FULL:-1} == 1 ]] && ( OUT=$OUT/full PROFILE=full FILTER="served-models/" \
      BACKENDS="$gpu_backends" JOBS=14 RUN_TIMEOUT=${RUN_TIMEOUT:-220} bash "$0" conformance )
    ;;
  multi-token)
    # issue 20: the multi-token families (ci: every query length and mask across the edge
    # families) on the GPU backends that claim them, the FlashInfer reproducers, and the gpu
    # bench shapes with 4 query tokens against one (triton-splitkv, FlashInfer's prefill
    # path for 4, its tensor-core decode for 1)
    mt_backends="triton-splitkv torch-flex torch-sdpa flashinfer-prefill"
    for probe in ${PROBES:-docs/findings/flashinfer_alibi_lse_absolute.py}; do
      echo "== $probe"; timeout 120 python3 "$probe" 2>&1 | tail -8
    done > "$OUT/reproducers.txt" 2>&1 &
    probes=$!
    ( OUT=$OUT/ci PROFILE=ci FILTER=qlen BACKENDS="${MT_BACKENDS:-$mt_backends}" JOBS=14 \
      RUN_TIMEOUT=${RUN_TIMEOUT:-300} bash "$0" conformance )
    wait "$probes"; cat "$OUT/reproducers.txt"
    mkdir -p "$OUT/bench"
    for name in ${BENCH_BACKENDS:-triton-splitkv flashinfer-prefill flashinfer-tc}; do
      timeout "${BENCH_TIMEOUT:-100}" python3 -m conformance bench --shapes gpu --rounds 2 \
        --backend "$name" --report-json "$OUT/bench/$name.json" 2>&1 | tail -30
    done
    ;;
  mla)
    # issue 21: the MLA families (ci: every edge family on small latents and DeepSeek's; then
    # full: DeepSeek's long contexts) on the backends that claim MLA, and the MLA bench shapes
    # on the Triton kernel and FlashInfer's in one run; carry .flashinfer/
    mla_backends="triton-mla flashinfer-mla torch-flex tvm-cuda"
    ( OUT=$OUT/ci PROFILE=ci FILTER=mla/ BACKENDS="${MLA_BACKENDS:-$mla_backends}" JOBS=14 \
      RUN_TIMEOUT=${RUN_TIMEOUT:-200} bash "$0" conformance )
    ( OUT=$OUT/full PROFILE=full FILTER=mla/deepseek-long BACKENDS="triton-mla flashinfer-mla tvm-cuda" \
      JOBS=4 RUN_TIMEOUT=${FULL_TIMEOUT:-150} bash "$0" conformance )
    timeout "${BENCH_TIMEOUT:-150}" python3 -m conformance bench --shapes mla --rounds 3 \
      --backend triton-mla --backend flashinfer-mla --backend tvm-cuda \
      --report-json "$OUT/bench-mla.json"
    ;;
  explore-variants)
    mkdir -p "$OUT/fp8" "$OUT/modifiers"
    ( OUT=$OUT/fp8 EXPLORE_BACKENDS="triton-splitkv triton-paged flashinfer flashinfer-tc" \
      EXPLORE_ARGS=--fp8 EXPLORE_SECONDS=${EXPLORE_SECONDS:-150} bash "$0" explore ) &
    ( OUT=$OUT/modifiers EXPLORE_BACKENDS="triton-splitkv triton-paged torch-flex flashinfer" \
      EXPLORE_SECONDS=${EXPLORE_SECONDS:-150} bash "$0" explore ) &
    wait
    ;;
  explore)
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l); (( gpus > 0 )) || gpus=1
    slot=0
    for name in ${EXPLORE_BACKENDS:-tvm-cuda triton-splitkv triton-paged triton-contiguous}; do
      aot=(); [[ $name == tvm-* && -d .aot-explore ]] && aot=(env CONFORMANCE_TVM_AOT="$PWD/.aot-explore")
      CUDA_VISIBLE_DEVICES=$(( slot % gpus )) "${aot[@]}" timeout $(( ${EXPLORE_SECONDS:-480} + 90 )) \
        python3 -m conformance explore --backend "$name" --time-budget "${EXPLORE_SECONDS:-480}" \
        --max-examples 100000 --seed "${SEED:-0}" ${EXPLORE_ARGS:-} --report-json "$OUT/explore-$name.json" \
        --save-spec "$OUT/explore-$name.toml" > "$OUT/explore-$name.log" 2>&1 &
      slot=$(( slot + 1 ))
    done
    wait
    for log in "$OUT"/explore-*.log; do
      echo "== $log"; grep -E "^explored|^- |smallest case" "$log" | cut -c1-300
    done
    ;;
  device-fault)
    # a Triton store out of bounds (sticky CUDA error) against the same trigger raised in
    # Python, serial and -j 4: the verdicts must be the same (tests/hostile_gpu.py)
    for jobs in ${FAULT_JOBS:-4 1}; do
      for backend in RaisesOnTheSameCases OutOfBoundsStore; do
        start=$(date +%s)
        timeout 400 python3 -m conformance run --profile ci -k group-sizes -j $jobs \
          --backend "tests.hostile_gpu:$backend" --report-json "$OUT/fault-$backend-j$jobs.json" \
          > "$OUT/fault-$backend-j$jobs.log" 2>&1
        echo "$backend -j $jobs rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/device-fault.txt"
        grep -E "^  (gpu|worker)" "$OUT/fault-$backend-j$jobs.log" | head -12 | tee -a "$OUT/device-fault.txt"
      done
      python3 - "$OUT/fault-RaisesOnTheSameCases-j$jobs.json" "$OUT/fault-OutOfBoundsStore-j$jobs.json" <<'PY' | tee -a "$OUT/device-fault.txt"
import collections, json, sys
plain, lost = (json.load(open(path)) for path in sys.argv[1:])
verdict = lambda report: {(r["case"], r["check"]): r["status"] for r in report["results"]}
for name, report in (("python error", plain), ("lost device", lost)):
    print(name, dict(collections.Counter(r["status"] for r in report["results"])),
          "worker restarts:", sum(len(e["reasons"]) for e in report.get("worker_restarts", [])))
same = verdict(plain) == verdict(lost)
print("same verdicts:", same, "over", len(verdict(plain)), "checks")
for key in sorted(set(verdict(plain)) | set(verdict(lost))):
    if verdict(plain).get(key) != verdict(lost).get(key):
        print("  differs:", key, verdict(plain).get(key), verdict(lost).get(key))
PY
    done
    gzip -f "$OUT"/fault-*.json
    ;;
  index-widths)
    gpu_backends=(); for name in ${BACKENDS:-triton-paged triton-splitkv triton-contiguous flashinfer flashinfer-tc torch-flex torch-sdpa}; do
      gpu_backends+=(--backend "$name")
    done
    if [[ ${PART:-1} == 1 ]]; then
      start=$(date +%s)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_planted.py -k flat_offsets \
        > "$OUT/flat-offset-test.log" 2>&1
      echo "planted int32 flat offset test rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/index-widths.txt"
      tail -3 "$OUT/flat-offset-test.log" | tee -a "$OUT/index-widths.txt"
      runs=("full -k large-offset --check oracle -j 3")
    else
      runs=("ci -k q2kv1-d64 -j 8" "ci -k very-negative -j 8")
    fi
    for run in "${runs[@]}"; do
      name=$(echo "$run" | tr -c 'a-z0-9' '-' | cut -c1-40)
      start=$(date +%s)
      # shellcheck disable=SC2086
      timeout "${RUN_TIMEOUT:-300}" python3 -m conformance run --profile $run --case-timeout 400 \
        "${gpu_backends[@]}" --report-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "$run: rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/index-widths.txt"
      grep -v "cases, " "$OUT/$name.log" | tail -30 | cut -c1-400 | tee -a "$OUT/index-widths.txt"
      rm -f "$OUT/$name.log"; gzip -f "$OUT/$name.json" 2>/dev/null
    done
    ;;
  speed)
    # issue 22: the harness's own speed. SPEED_BACKEND (triton-splitkv) ci with cold compile
    # caches, then warm (JOBS, then half as many); numpy ci; then full, warm, cut at
    # FULL_TIMEOUT seconds
    backend=${SPEED_BACKEND:-triton-splitkv}
    jobs=${JOBS:-16}
    timed "ci-$backend-cold" 300 --backend "$backend" --profile ci
    if [[ -n ${BASELINE:-} ]]; then  # BASELINE: an older checkout's folder, side by side on
      # its own ci spec, warm, alternating (ROUNDS), with this tree given that spec
      TREE=$(realpath "$BASELINE") timed "ci-$backend-baseline-cold" 300 --backend "$backend" --profile ci
      for round in $(seq "${ROUNDS:-3}"); do
        TREE=$(realpath "$BASELINE") timed "ci-$backend-baseline-$round" 300 --backend "$backend" --profile ci
        timed "ci-$backend-baseline-spec-$round" 300 --backend "$backend" --profile ci \
          --spec "$BASELINE/conformance/spec.toml"
      done
    fi
    timed "ci-$backend-warm" 300 --backend "$backend" --profile ci
    # half the jobs: each job's harness and worker then have a CPU each, and wait by polling
    [[ ${HALF_JOBS:-1} == 1 ]] && \
      jobs=$(( jobs / 2 )) timed "ci-$backend-warm-half-jobs" 300 --backend "$backend" --profile ci
    timed "ci-numpy" 300 --backend numpy --profile ci
    # A profiled warm ci (2026-12-05) compiled 776 modules from source in each fresh worker
    # (2.7 s a worker): whether this Python keeps the libraries' bytecode (where it does not,
    # --cache-dir keeps the workers' under its python/ folder: conformance/caches.py)
    python3 -c "import sys; from conformance.caches import libraries_bytecode_kept as kept
print('dont_write_bytecode', sys.flags.dont_write_bytecode, 'pycache_prefix',
      sys.pycache_prefix, 'libraries_bytecode_kept', kept())" > "$OUT/python-bytecode.txt" 2>&1
    [[ ${FULL_TIMEOUT:-330} != 0 ]] && \
      timed "full-$backend-warm" "${FULL_TIMEOUT:-330}" --backend "$backend" --profile full
    ;;
  speed-full)
    # issue 22: SPEED_BACKEND's full profile, -j JOBS, ROUNDS times (the first cold on a fresh
    # machine), each cut at FULL_TIMEOUT; then each case of PROFILE_CASES (ids) alone, profiled
    # TREES: folders of older checkouts ("." this one), each round running each in turn;
    # PROFILES: the profiles each tree runs in a round (default full; "ci full": both)
    backend=${SPEED_BACKEND:-triton-splitkv}
    jobs=${JOBS:-16}
    for round in $(seq "${ROUNDS:-1}"); do
      for tree in ${TREES:-.}; do
        label=$(basename "$(realpath "$tree")")
        [[ $tree == . ]] && label=this
        for profile in ${PROFILES:-full}; do
          TREE=$([[ $tree != . ]] && realpath "$tree") timed "$profile-$backend-$label-$round" \
            "${FULL_TIMEOUT:-420}" --backend "$backend" --profile "$profile" \
            $([[ $tree == . ]] && echo --durations 20)
        done
      done
    done
    for id in ${PROFILE_CASES:-}; do
      name=$(echo "$id" | tr -c 'A-Za-z0-9.-' _ | cut -c1-80)
      jobs=1 CONFORMANCE_PROFILE=$OUT/profile-$name timed "profiled-$name" \
        "${PROFILE_TIMEOUT:-200}" --backend "$backend" --profile full --case "$id"
      python3 benchmarks/profile_report.py "$OUT/profile-$name" --top 30 \
        > "$OUT/profile-report-$name.txt" 2>&1
      tar -czf "$OUT/profile-$name.tar.gz" -C "$OUT" "profile-$name" && rm -rf "$OUT/profile-$name"
      head -60 "$OUT/profile-report-$name.txt"
    done
    ;;
  speed-threads)
    # issue 22: whether the libraries' own threads (OpenBLAS, OpenMP: a core each by default,
    # in every one of a -j run's processes) slow a parallel run: the full cases matching
    # THREAD_FILTER, -j JOBS, by default and with one thread a process, alternating ROUNDS
    # times (the first fills the compile caches), then each of PROFILE_CASES alone, both ways
    backend=${SPEED_BACKEND:-triton-splitkv}
    jobs=${JOBS:-16}
    one=(OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1)
    timed "full-$backend-fill" 300 --backend "$backend" --profile full -k "$THREAD_FILTER"
    for round in $(seq "${ROUNDS:-2}"); do
      timed "full-$backend-default-$round" 300 --backend "$backend" --profile full \
        -k "$THREAD_FILTER"
      env "${one[@]}" bash -c "$(declare -f timed); OUT=$OUT jobs=$jobs timed \
        full-$backend-one-thread-$round 300 --backend $backend --profile full -k '$THREAD_FILTER'"
    done
    for id in ${PROFILE_CASES:-}; do
      name=$(echo "$id" | tr -c 'A-Za-z0-9.-' _ | cut -c1-60)
      jobs=1 timed "alone-default-$name" 200 --backend "$backend" --profile full --case "$id"
      env "${one[@]}" bash -c "$(declare -f timed); OUT=$OUT jobs=1 timed \
        alone-one-thread-$name 200 --backend $backend --profile full --case '$id'"
    done
    ;;
  same-reports)
    backend=${SPEED_BACKEND:-triton-splitkv}
    filter=${SAME_FILTER:-served-models/qwen2.5-7b}
    jobs=${JOBS:-16}
    timed "same-j$jobs" 300 --backend "$backend" --profile full -k "$filter"
    jobs=1 timed "same-j1" 300 --backend "$backend" --profile full -k "$filter"
    jobs=1 timed "same-in-process" 300 --backend "$backend" --profile full -k "$filter" --in-process
    python3 - "$OUT" "same-j$jobs" same-j1 same-in-process <<'PY' | tee -a "$OUT/runs.txt"
import gzip, json, sys
folder, *names = sys.argv[1:]
results = [json.load(gzip.open(f"{folder}/{name}.json.gz"))["results"] for name in names]
for name, other in zip(names[1:], results[1:]):
    differ = sum(a != b for a, b in zip(results[0], other)) + abs(len(results[0]) - len(other))
    print(f"{names[0]} against {name}: {len(other)} results, {differ} differ")
PY
    ;;
  upload-rate)
    python3 - "${UPLOAD_GB:-4.3}" "${ROUNDS:-3}" <<'PY' | tee -a "$OUT/runs.txt"
import sys, time
import numpy as np, torch
from conformance.backends.tensors import to_torch_many
size, rounds = int(float(sys.argv[1]) * 1e9), int(sys.argv[2])
pool = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
ways = {"pageable .to": lambda: torch.from_numpy(pool).to("cuda"),
        "pinned chunks": lambda: to_torch_many({"pool": pool}, "cuda")["pool"]}
for _ in range(rounds):
    for name, upload in ways.items():
        torch.cuda.synchronize(); start = time.perf_counter()
        moved = upload(); torch.cuda.synchronize(); seconds = time.perf_counter() - start
        same = bool((moved[::4099].cpu().numpy() == pool[::4099]).all())
        print(f"{name}: {size / 1e9:.1f} GB in {seconds:.3f} s, {size / seconds / 1e9:.1f} GB/s, same {same}")
        del moved
PY
    ;;
  speed-fork)
    backend=${SPEED_BACKEND:-triton-splitkv}
    jobs=${JOBS:-16}
    timed "ci-$backend-cold" 300 --backend "$backend" --profile ci
    for profile in ci $([[ ${FULL:-1} == 1 ]] && echo full); do
      for round in $(seq "${ROUNDS:-2}"); do
        for fork in 0 1; do
          for early in ${EARLY:-1}; do
            CONFORMANCE_FORK=$fork CONFORMANCE_EARLY_CONTEXT=$early \
              timed "$profile-$backend-fork$fork-early$early-$round" 300 \
              --backend "$backend" --profile "$profile"
          done
        done
      done
    done
    for how in "" --fork "--late-context" "--fork --late-context"; do
      python3 benchmarks/worker_start.py --backend "$backend" --workers "$jobs" $how \
        | tee -a "$OUT/runs.txt"
    done
    # the runs' fork notes; none: every worker was forked after the zygote's whole preload
    { grep -h -E "not forked|forked after part" "$OUT"/*.log | sort | uniq -c \
      || echo "no fork note: every forked worker had the whole preload"; } | tee -a "$OUT/runs.txt"
    ;;
  speed-profile)
    # issue 22: where a warm ci run's time goes on the GPU: SPEED_BACKEND's ci cold (to fill
    # the compile caches), warm, then warm with every process profiled
    # (CONFORMANCE_PROFILE), summed per role by benchmarks/profile_report.py
    backend=${SPEED_BACKEND:-triton-splitkv}
    jobs=${JOBS:-16}
    timed "ci-$backend-cold" 300 --backend "$backend" --profile ci
    timed "ci-$backend-warm" 300 --backend "$backend" --profile ci
    CONFORMANCE_PROFILE=$OUT/profile timed "ci-$backend-warm-profiled" 300 \
      --backend "$backend" --profile ci
    for order in tottime cumtime; do
      python3 benchmarks/profile_report.py "$OUT/profile" --top 40 --sort "$order" \
        > "$OUT/profile-report-$order.txt"
    done
    tar -czf "$OUT/profile.tar.gz" -C "$OUT" profile && rm -rf "$OUT/profile"
    grep "^==" "$OUT/profile-report-tottime.txt"
    ;;
  pytest-bench)
    bench=(python3 -m pytest benchmarks -p no:cacheprovider --bench-backend "${BENCH_BACKEND:-triton-splitkv}"
           --bench-shapes "${BENCH_SHAPES:-gpu}" --benchmark-storage "file://$OUT/benchmarks" --benchmark-columns=median,iqr,min,max)
    "${bench[@]}" --benchmark-save=base --benchmark-json "$OUT/pytest-bench-base.json"
    echo "save rc=$?"
    "${bench[@]}" --benchmark-compare=0001 --benchmark-compare-fail=median:10% \
      --benchmark-json "$OUT/pytest-bench-compare.json"
    echo "compare rc=$?"
    rm -rf "$OUT/benchmarks"
    ;;
esac
