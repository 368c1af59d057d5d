"""Launch-parameter sweep of the split-KV kernel on the GPU shapes (run on a GPU machine).

    python benchmarks/sweep_splitkv.py --out sweep.json [--fp8 | --splits | --mla]
        [--shape NAME ...] [--grid '{"BLOCK_N": [64, 128], ...}']

For every shape of the ``gpu`` set and every (BLOCK_N, num_warps, num_stages, waves), the
median time by ``time_cuda``; prints the best configuration per shape. ``--fp8``: the shapes'
e4m3 twins (per-tensor scales) over the pipeline depths and the ways of reading fp8 tiles
(``fp8_words``); each row records how far its output lies from the first configuration's
(the same values whichever way the codes are read: 0). ``--splits``: every shape, float16
and e4m3, at its default configuration over split counts that fill the GPU with k = 1..6
programs per SM (and one either side), next to the count the heuristic picks. ``--mla``: the
MLA kernel (``mla_kernel``) on the ``mla`` shapes over heads per tile, tokens per tile and
warps. ``--shape`` keeps the named bench shapes (an fp8 twin is named ``NAME-kv-e4m3``);
``--grid`` replaces some of the grid's lists with those given, as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

from conformance.backends.tensors import to_torch
from conformance.backends.triton import runtime

GRID = {"BLOCK_N": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3],
        "waves": [1, 2, 4], "loop_stages": [None], "head_major": [False]}
# fp8_words: tiles read as fp8 (0), V (1) or K and V (2) as 32-bit words of four codes;
# loop_stages: the tile loop's own tl.range(num_stages=), which pipelines every load in it
# (None: only the loads that feed a tl.dot, by the launch's num_stages); head_major: the pages
# stored (pages, kv_heads, page_size, dim), a page's rows of one head contiguous (an fp8 row
# of 128 codes is 128 bytes apart from the next token's in the problem's layout)
GRID_MLA = {"BLOCK_H": [16, 32, 64], "BLOCK_N": [16, 32], "num_warps": [4, 8],
            "num_stages": [2], "waves": [2]}
GRID_FP8 = {"BLOCK_N": [128], "num_warps": [4], "num_stages": [2, 3, 4], "waves": [2, 4],
            "fp8_words": [0, 1, 2], "loop_stages": [None], "head_major": [False]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fp8", action="store_true", help="the e4m3 twins of the shapes")
    parser.add_argument("--splits", action="store_true",
                        help="split counts at the default configuration, both caches")
    parser.add_argument("--mla", action="store_true", help="the MLA kernel on the mla shapes")
    parser.add_argument("--shape", action="append", default=[],
                        help="only this bench shape (repeatable)")
    parser.add_argument("--grid", type=json.loads, default={},
                        help="JSON: lists replacing the grid's, by parameter")
    args = parser.parse_args()
    grid = GRID_MLA if args.mla else GRID_FP8 if args.fp8 else GRID
    unknown = sorted(set(args.grid) - set(grid))
    if unknown:
        parser.error(f"--grid: {unknown[0]!r} is not one of {', '.join(grid)}")
    grid = {**grid, **args.grid}
    mode = runtime.select_mode()
    import torch

    from conformance.backends.triton.kernel_common import choose_splits
    from conformance.backends.triton.mla_kernel import mla_decode
    from conformance.backends.triton.splitkv_kernel import splitkv_decode, tile_config
    from conformance.backends.triton.validation import Scales
    from conformance.bench import copy_bandwidth, select_shapes, time_cuda
    from conformance.materialise import materialise
    from conformance.problem import poisoned_outputs

    copy_rate = copy_bandwidth()
    rows = []

    def save() -> None:  # after every row: a sweep cut by a time limit keeps what it measured
        with open(args.out, "w") as handle:
            json.dump({"copy_bytes_per_s": copy_rate, "gpu": torch.cuda.get_device_name(0),
                       "rows": rows}, handle, indent=1)
    for shape in select_shapes("mla" if args.mla else "gpu"):
        if (shape.kv_lora_rank is not None) != args.mla:
            continue
        if (shape.kv_dtype is not None) != args.fp8 and not args.splits:
            continue
        if shape.query_len > 1:  # one query token per sequence: the launch takes no Queries
            continue
        if args.shape and shape.name not in args.shape:
            continue
        problem = materialise(shape.case())
        tensors = {k: to_torch(v, "cuda") for k, v in problem.arrays().items()}
        out, lse = poisoned_outputs(problem, 0.0)
        out_t, lse_t = to_torch(out, "cuda"), to_torch(lse, "cuda")
        scales = Scales(problem.kv_scale, tensors.get("k_scale"), tensors.get("v_scale"))
        best, first = None, None
        default = tile_config(shape.head_dim, shape.kv_dtype is not None,
                              batch=shape.batch)
        picked = choose_splits(shape.batch, shape.num_kv_heads, shape.context, mode.sm_count,
                               default["BLOCK_N"], default["waves"])
        if args.mla:  # the latent pool is k_pages; its value is a view, not an input
            launch = partial(mla_decode, tensors["q"], tensors["k_pages"],
                             kv_lora_rank=shape.kv_lora_rank)
            programs, picked = None, None
        else:
            launch = partial(splitkv_decode, tensors["q"], scales=scales)
            programs = shape.num_kv_heads
        if args.splits:
            per_split = shape.batch * shape.num_kv_heads
            useful = -(-shape.context // (2 * default["BLOCK_N"]))
            counts = {picked} | {max(1, round(k * mode.sm_count / per_split)) + step
                                 for k in range(1, 7) for step in (-1, 0, 1)}
            runs = [(default, n) for n in sorted(counts) if 1 <= n <= min(useful, 256)]
        else:
            runs = []
            for values in itertools.product(*grid.values()):
                config = dict(zip(grid, values, strict=True))
                heads = programs or -(-shape.num_qo_heads // config["BLOCK_H"])
                runs.append((config, choose_splits(shape.batch, heads, shape.context,
                                                   mode.sm_count, config["BLOCK_N"],
                                                   config["waves"])))
        for config, splits in runs:
            pages = () if args.mla else paged(tensors, config.get("head_major", False))
            call = partial(launch, *pages, tensors["block_table"], tensors["context_lens"],
                           out_t, lse_t, sm_scale=problem.sm_scale, num_splits=splits,
                           validate=False, config=config)

            try:
                seconds = time_cuda(call)
            except Exception as exc:  # a configuration that does not compile or launch
                rows.append({"shape": shape.name, **config, "error": repr(exc)[:200]})
                save()
                continue
            fraction = shape.kv_bytes / seconds / copy_rate
            call()
            result = out_t.float().clone()
            if first is None:
                first = result
            rows.append({"shape": shape.name, **config, "splits": splits, "picked": picked,
                         "median_us": seconds * 1e6, "fraction_of_copy": fraction,
                         "max_diff_from_first": float((result - first).abs().max())})
            if best is None or fraction > best["fraction_of_copy"]:
                best = rows[-1]
            save()
        print(f"{shape.name:16} best {best}", flush=True)
        del tensors, out_t, lse_t
        torch.cuda.empty_cache()


def paged(tensors: dict, head_major: bool) -> tuple:
    """K and V pages as the kernel reads them: the problem's, or (``head_major``) copies stored
    ``(pages, kv_heads, page_size, dim)`` seen through the problem's shape, made once."""
    if not head_major:
        return tensors["k_pages"], tensors["v_pages"]
    if "k_head_major" not in tensors:
        for name in ("k", "v"):
            tensors[f"{name}_head_major"] = (
                tensors[f"{name}_pages"].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3))
    return tensors["k_head_major"], tensors["v_head_major"]


if __name__ == "__main__":
    main()
