"""Hypothesis strategies for decode cases, drawn inside what a backend claims.

Built from the same ``Capabilities`` record the fixed spec is filtered by, so a drawn case is
one the backend says it supports. Sizes are drawn from ranges, not the spec's lists, with
weight on the edges kernels get wrong (0 and 1 tokens, page multiples and one either side,
non-powers of two), and every draw shrinks towards the smallest case: one sequence, few
tokens, one KV head, the smallest head_dim and page size. A backend claiming MLA gets MLA
cases too (a latent of its ``latent_dims``, every head on the one latent, no fp8, modifiers
or drafts: the spec does not combine them with MLA yet).
"""

from __future__ import annotations

import math

from hypothesis import assume
from hypothesis import strategies as st

from conformance.backends.base import Capabilities, Instance
from conformance.dtypes import DTYPES
from conformance.spec import DISTRIBUTIONS, KV_SCALINGS, MLA_DISTINCT_VALUES, Case

# MLA latents drawn when a backend claims any: (kv_lora_rank, rope_dim), small first, a
# latent that is no power of two, and DeepSeek's. Every key width is a multiple of 32, as
# every listed head_dim is, so that a head_dim bug explore finds shrinks to a GQA case.
LATENT_DIMS = ((16, 16), (32, 32), (96, 32), (128, 64), (512, 64))

# Examples stay cheap: tokens x query heads x head_dim at most this (a CPU second or less).
CPU_COST_CAP = 400_000
GPU_COST_CAP = 50_000_000
HEAD_DIMS = tuple(range(8, 257, 8))  # when a backend claims any head_dim
MAX_PAGE_SIZE = 64  # when it claims any page size
MAX_KV_HEADS = 8
MAX_GROUP = 24
MAX_BATCH = 40  # past the usual 32-wide grid dimension
# The wide regimes, each opened in one example of RARELY (and shrunk off): contexts past
# int16/uint16 lengths, pools past int16/uint16 page ids, windows past 64 tokens with
# first-N sinks. Tiny heads keep them cheap: at most WIDE_COST tokens x heads x head_dim,
# and a pool of at most WIDE_POOL_ELEMENTS.
RARELY = 12
LONG_CONTEXTS = (32767, 32768, 40000, 65535, 65536, 70000)
WIDE_POOLS = (32768, 40000, 65536, 70000, 140000)
WIDE_COST = 10_000_000
WIDE_POOL_ELEMENTS = 1 << 23


def _sizes(claimed: frozenset[int] | None, default: st.SearchStrategy[int]
           ) -> st.SearchStrategy[int]:
    return default if claimed is None else st.sampled_from(sorted(claimed))


def _instances(capabilities: Capabilities) -> st.SearchStrategy[Instance]:
    """The claimed kernel instances the other fields allow, smallest (fewest heads) first
    so that a failure shrinks towards the smallest instance that still fails."""
    allowed = [i for i in capabilities.instances or ()
               if capabilities.unsupported_reason(_bare_case(i)) is None]
    if not allowed:
        raise ValueError("no claimed instance is inside the other capabilities")
    order = list(DTYPES)
    return st.sampled_from(sorted(allowed, key=lambda i: (i[0] * i[2], i[:4],
                                                          order.index(i[4]))))


def _bare_case(instance: Instance) -> Case:
    qo, kv, head_dim, page_size, dtype = instance
    return Case(family="explore", num_qo_heads=qo, num_kv_heads=kv, head_dim=head_dim,
                page_size=page_size, dtype=dtype, context_lens=(1,), distribution="normal")


def _rarely(draw: st.DrawFn) -> bool:
    """True in one draw of ``RARELY``; shrinks to False."""
    return draw(st.sampled_from(range(RARELY))) == RARELY - 1


def _context_length(page_size: int, long: bool = False) -> st.SearchStrategy[int]:
    """Short lengths, page multiples and one either side, up to 600; with ``long``, also
    lengths past int16 and uint16 (the last branch, so that a failure shrinks off it)."""
    edges = st.builds(lambda pages, delta: max(0, pages * page_size + delta),
                      st.integers(1, 8), st.sampled_from((-1, 0, 1)))
    branches = [st.integers(0, 3), edges, st.integers(0, 600)]
    return st.one_of(*branches, st.sampled_from(LONG_CONTEXTS)) if long else \
        st.one_of(*branches)


def _quantization(draw: st.DrawFn, capabilities: Capabilities, num_kv_heads: int,
                  fp8: bool) -> dict:
    """An fp8 cache (format, scale layout, scaling) and query the backend claims, drawn in
    one example of two (every one with ``fp8``); shrinks to none, then per-tensor and fit."""
    fields: dict = {}
    if capabilities.kv_dtypes and (fp8 or draw(st.booleans())):
        scalings = [s for s in KV_SCALINGS if s != "spread" or num_kv_heads > 1]
        fields = {"kv_dtype": draw(st.sampled_from(sorted(capabilities.kv_dtypes))),
                  "kv_scale": draw(st.sampled_from(sorted(
                      capabilities.kv_scales, key=("per-tensor", "per-head",
                                                   "per-token").index))),
                  "kv_scaling": draw(st.sampled_from(scalings))}
    if capabilities.q_dtypes and draw(st.booleans()):
        fields["q_dtype"] = draw(st.sampled_from(sorted(capabilities.q_dtypes)))
    return fields


def _modifiers(draw: st.DrawFn, features: frozenset[str], num_qo_heads: int) -> dict:
    """Soft-cap, sink logits and ALiBi where claimed, each on one example of three; caps
    from 1 (every score bent) to 50, sink logits drawn or all -inf, standard or drawn slopes.
    Each shrinks to absent."""
    fields: dict = {}
    if "soft_cap" in features and draw(st.integers(0, 2)) == 2:
        fields["soft_cap"] = draw(st.sampled_from((30.0, 50.0, 1.0, 5.0)))
    if "sink_logits" in features and draw(st.integers(0, 2)) == 2:
        fields["sink_logits"] = draw(st.one_of(
            st.sampled_from(("normal", "large", "minus-inf")),
            st.lists(st.floats(-20.0, 20.0), min_size=num_qo_heads, max_size=num_qo_heads)
            .map(tuple)))
    if "alibi" in features and draw(st.integers(0, 2)) == 2:
        fields["alibi"] = draw(st.one_of(st.just(True), st.lists(
            st.floats(0.0, 1.0), min_size=num_qo_heads, max_size=num_qo_heads).map(tuple)))
    return fields


def _drafts(draw: st.DrawFn, features: frozenset[str], context_lens: list[int]) -> dict:
    """Several query tokens per sequence where claimed, on one example of three: 1-8 per
    sequence (a context grown to hold its drafts), causal or, where claimed, a tree, a chain
    or all drafts seeing all. Shrinks to one token per sequence."""
    if "multi_token" not in features or draw(st.integers(0, 2)) != 2:
        return {}
    lens = [draw(st.integers(1, 8)) for _ in context_lens]
    for b, query_len in enumerate(lens):
        context_lens[b] = max(context_lens[b], query_len)
    fields: dict = {"query_lens": tuple(lens)}
    if "draft_mask" in features and draw(st.booleans()):
        fields["mask"] = draw(st.sampled_from(("tree", "chain", "all")))
    return fields


@st.composite
def cases(draw: st.DrawFn, capabilities: Capabilities, cost_cap: int = CPU_COST_CAP,
          features: frozenset[str] | None = None, fp8: bool = False) -> Case:
    """A case the capabilities claim, no costlier than ``cost_cap``; with ``fp8``, only
    cases with an fp8 cache (the backend must claim one)."""
    features = capabilities.features if features is None else features
    long_context, wide_pool = _rarely(draw), _rarely(draw)
    wide = long_context or wide_pool  # tiny heads, and the cost cap is WIDE_COST
    # MLA on one example of four where GQA is claimed too (it shrinks to GQA), else always
    mla = "mla" in capabilities.kinds and (
        "gqa" not in capabilities.kinds or draw(st.integers(0, 3)) == 3)
    kv_lora_rank = None
    if mla:  # one latent shared by every head: a group of all of them
        dtype = draw(st.sampled_from(sorted(set(capabilities.dtypes) & set(DTYPES),
                                            key=list(DTYPES).index)))
        latents = LATENT_DIMS if capabilities.latent_dims is None else sorted(
            capabilities.latent_dims)
        if wide:  # tiny heads, as for GQA
            latents = [p for p in latents if sum(p) <= 32] or latents[:1]
        kv_lora_rank, rope_dim = draw(st.sampled_from(latents))
        num_kv_heads, head_dim = 1, kv_lora_rank + rope_dim
        group = draw(st.integers(1, 2) if wide else st.one_of(
            st.integers(1, 16), st.sampled_from((16, 32, 64, 128))))
        page_size = draw(_sizes(capabilities.page_sizes, st.integers(1, MAX_PAGE_SIZE)))
    elif capabilities.instances is not None:
        num_qo_heads, num_kv_heads, head_dim, page_size, dtype = draw(_instances(capabilities))
        group = num_qo_heads // num_kv_heads
    else:
        dtype = draw(st.sampled_from(sorted(set(capabilities.dtypes) & set(DTYPES),
                                            key=list(DTYPES).index)))
        num_kv_heads = 1 if wide else draw(st.integers(1, MAX_KV_HEADS))
        max_group = min(MAX_GROUP, capabilities.max_group_size or MAX_GROUP, 2 if wide else
                        MAX_GROUP)
        if capabilities.group_sizes is not None:
            group = draw(st.sampled_from(sorted(capabilities.group_sizes)))
        else:
            group = draw(st.integers(1, max_group))
        head_dims = HEAD_DIMS if capabilities.head_dims is None else sorted(
            capabilities.head_dims)
        if wide:
            head_dims = [d for d in head_dims if d <= 32] or head_dims[:1]
        head_dim = draw(st.sampled_from(head_dims))
        page_size = draw(_sizes(capabilities.page_sizes, st.integers(1, MAX_PAGE_SIZE)))
    batch = draw(st.integers(1, 4) if wide else
                 st.one_of(st.integers(1, 4), st.integers(1, MAX_BATCH)))
    context_lens = list(draw(st.lists(_context_length(page_size, long_context),
                                      min_size=batch, max_size=batch)))
    if long_context:
        assume(page_size >= 16)  # a page walk of 70000 pages costs a CPU minute a case
    window = sinks = None
    if "sliding_window" in features and draw(st.booleans()):
        window = draw(st.integers(1, 3 * page_size + 5))
        if "sinks" in features and draw(st.booleans()):
            sinks = draw(st.integers(1, window + page_size))
            if _rarely(draw):  # a wide window with sinks, over a context past both
                window, sinks = draw(st.integers(65, 600)), draw(st.integers(1, 64))
                context_lens[0] = max(context_lens[0], window + sinks + draw(st.integers(1, 300)))
    pool_pages = 0
    if wide_pool:
        pool_pages = draw(st.sampled_from(WIDE_POOLS))
        assume(pool_pages * page_size * num_kv_heads * head_dim <= WIDE_POOL_ELEMENTS)
    distribution = draw(st.sampled_from(tuple(
        d for d in DISTRIBUTIONS if not (mla and d in MLA_DISTINCT_VALUES))))
    # "large" and "very-negative" set the scores' size themselves (q and k are scaled up to
    # reach it); a custom sm_scale on top only inflates q and k past what float32 holds
    # (terms of ~1e7 summing to -1e5), a case no kernel or budget can be fair on
    sm_scale = None if distribution in ("large", "very-negative") else draw(
        st.one_of(st.none(), st.sampled_from((0.01, 0.05, 0.3, 1.0))))
    num_splits = None  # a split count the backend names, crossed with every distribution
    if "split_k" in features and capabilities.split_counts and draw(st.booleans()):
        num_splits = draw(st.sampled_from(capabilities.split_counts))
    drafts = {} if mla else _drafts(draw, features, context_lens)
    num_qo_heads = num_kv_heads * group
    if wide:
        assume(num_qo_heads <= 4)  # a backend's instances may hold no tinier one
    assume(sum(context_lens) * num_qo_heads * head_dim <= (WIDE_COST if wide else cost_cap))
    case = Case(family="explore", num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, page_size=page_size, dtype=dtype,
                context_lens=tuple(context_lens), distribution=distribution, window=window,
                sinks=sinks or 0, sm_scale=sm_scale, num_splits=num_splits,
                pool_pages=pool_pages, kv_lora_rank=kv_lora_rank,
                **({} if mla else _quantization(draw, capabilities, num_kv_heads, fp8)),
                **({} if mla else _modifiers(draw, features, num_qo_heads)), **drafts)
    assume(capabilities.unsupported_reason(case) is None)
    return case


def cost(case: Case) -> int:
    return sum(case.context_lens) * case.num_qo_heads * case.head_dim


def is_power_of_two(n: int) -> bool:
    return n > 0 and 2 ** int(math.log2(n)) == n


def draw_instances(capabilities: Capabilities, count: int, seed: int = 0,
                   cost_cap: int = GPU_COST_CAP) -> list[Case]:
    """One drawn case for each of the first ``count`` distinct kernel instances that
    ``cases`` draws with this seed: what an ahead-of-time build for explore must hold."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed

    from conformance.backends.base import instance_of

    found: dict[Instance, Case] = {}

    @hyp_seed(seed)
    @settings(max_examples=20 * count, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(cases(capabilities, cost_cap))
    def collect(case: Case) -> None:
        if len(found) < count:
            found.setdefault(instance_of(case), case)

    collect()
    return list(found.values())
