"""``bench``: every backend in its worker, timed on named shapes; a table and the JSON."""

from __future__ import annotations

import argparse
import json
import platform

from conformance.bench import BenchResult, select_shapes
from conformance.commands import open_named
from conformance.inputs import check_output, write_atomically
from conformance.sandbox import describe_exception


def handle_bench(args: argparse.Namespace) -> int:
    """``python -m conformance bench``: every backend in its worker, a table and the JSON."""
    if args.report_json is not None:
        check_output(args.report_json, "--report-json")
    shapes = select_shapes(args.shapes, args.shape)
    backends = open_named(args.backend, args)
    if backends is None:
        return 2
    results, failed, copy_rate = [], 0, None
    machine = {"platform": platform.platform(), "python": platform.python_version()}
    print(f"{'backend':18} {'shape':18} {'median':>10} {'GB/s':>8} {'% copy':>7} {'spread':>7}")
    try:
        for backend in backends:
            handle = backend.connect(isolated=not args.in_process)
            handle.begin_case(args.case_timeout)
            try:
                device, rate, gpu = handle.call("timing_device")
            except Exception as exc:  # one backend's fault must not lose the other results
                failed += 1
                print(f"{backend.label:18} {'-':18} ERROR {describe_exception(exc)}", flush=True)
                continue
            if device == "cuda" and copy_rate is None:
                copy_rate = rate
                machine.update(gpu)
                print(f"device-to-device copy: {copy_rate / 1e12:.2f} TB/s (read + write)")
            for shape in shapes:
                handle.begin_case(args.case_timeout)
                try:
                    reason = handle.unsupported_reason(shape.case())
                except Exception as exc:
                    reason = f"its unsupported_reason raised {describe_exception(exc)}"
                    failed += 1
                if reason:
                    print(f"{backend.label:18} {shape.name:18} unsupported: {reason}",
                          flush=True)
                    continue
                try:
                    result = BenchResult.from_data(handle.call(
                        "bench", backend.label, shape, args.rounds,
                        copy_rate if device == "cuda" else None))
                except Exception as exc:
                    failed += 1
                    print(f"{backend.label:18} {shape.name:18} ERROR {describe_exception(exc)}",
                          flush=True)
                    continue
                results.append(result)
                share = f"{100 * result.fraction_of_copy:6.1f}%" if result.fraction_of_copy \
                    else "      -"
                print(f"{backend.label:18} {shape.name:18} {result.median_s * 1e6:8.1f}us "
                      f"{result.bytes_per_s / 1e9:8.1f} {share} {result.spread:7.3f}", flush=True)
    finally:
        for backend in backends:
            backend.disconnect()
    if args.report_json:
        write_atomically(args.report_json, json.dumps(
            {"schema": "paged-decode-conformance/bench/1", "machine": machine,
             "copy_bytes_per_s": copy_rate, "results": [r.as_dict() for r in results]},
            indent=1) + "\n")
        print(f"JSON: {args.report_json}")
    return 1 if failed else 0
