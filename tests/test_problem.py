"""Materialisation is adversarial: garbage (or NaN) where nothing may be read, shuffled and
shared pages."""

import math
from dataclasses import replace

import numpy as np
import pytest

from conformance.checks.oracle import reference_of
from conformance.materialise import logical_kv, materialise
from conformance.problem import POISONS, poisoned_outputs
from conformance.references import kept_tokens
from conformance.spec import Case, default_spec


def make_case(**fields):
    base = dict(family="t", num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                dtype="float32", context_lens=(10, 0, 7))
    return Case(**{**base, **fields})


def denoted(problem):
    """The values every slot's K and V denote, float64 (codes times scales for fp8)."""
    keys, values = problem.k_pages.astype(np.float64), problem.v_pages.astype(np.float64)
    if problem.k_scale is None:
        return keys, values
    slots = keys.shape[:3]

    def scales(scale):
        return np.broadcast_to(scale if scale.ndim == 3 else scale.reshape(1, 1, -1), slots)
    return keys * scales(problem.k_scale)[..., None], values * scales(problem.v_scale)[..., None]


def slot_roles(problem):
    """Per physical slot: True if some query row reads it."""
    read = np.zeros(problem.k_pages.shape[:2], dtype=bool)
    for row, b in enumerate(problem.row_sequence):
        kept = problem.kept(row)
        read[problem.block_table[b, kept // problem.page_size], kept % problem.page_size] = True
    return read


@pytest.mark.parametrize("case", default_spec().cases("ci")[::7], ids=lambda c: c.id)
def test_every_slot_not_read_is_nan_in_the_nan_layout_and_the_layouts_agree(case):
    garbage, problem = materialise(case), materialise(case, masked="nan")
    read = slot_roles(problem)
    values = problem.k_pages.astype(np.float32)
    if case.kv_dtype == "float8_e5m2":  # the format has inf: its keys hold that
        assert np.isposinf(values[~read]).all()
    else:
        assert np.isnan(values[~read]).all()
    assert np.isfinite(values[read]).all()
    assert np.isnan(problem.v_pages.astype(np.float32)[~read]).all()
    if case.kv_scale == "per-token" and case.kv_dtype:
        assert np.isnan(problem.k_scale[~read]).all() and np.isnan(problem.v_scale[~read]).all()
    # the same layout, only the masked fill differs
    assert (garbage.block_table == problem.block_table).all()
    assert (garbage.k_pages[read] == problem.k_pages[read]).all()
    assert np.isfinite(garbage.k_pages.astype(np.float32)).all()


@pytest.mark.parametrize("case", default_spec().cases("ci")[::7], ids=lambda c: c.id)
def test_garbage_would_change_the_answer_far_beyond_any_budget(case):
    problem = materialise(case)
    read = slot_roles(problem)
    keys, values = denoted(problem)
    garbage = np.abs(values[~read])  # (slots, kv_heads, dim)
    if case.kind == "mla":  # a value is its key's latent: garbage of the keys' spread below
        assert (values[~read] == keys[~read][..., :case.kv_lora_rank]).all()
    elif case.kv_dtype is None:
        assert (garbage == 1000.0).all()
    elif (~read).any() and read.any():  # 1000, or saturated: as far as the format reaches
        largest = np.abs(values[read]).max(axis=(0, 2))
        assert (garbage.min(axis=(0, 2)) >= np.minimum(900.0, largest)).all()
    if (~read).any() and case.distribution != "uniform":
        # a normal query meets scores of ~20 standard deviations among the garbage keys
        keys = keys[~read]
        scale = np.std(keys) * math.sqrt(case.head_dim) * case.scale
        # an fp8 scale caps what a slot can denote: saturated garbage keys give scores of
        # ~4.5 standard deviations (weights e^4.5 times a real token's), 20 otherwise
        assert scale > (10 if case.kv_dtype is None else 4)


def test_pool_is_larger_than_needed_and_page_zero_is_never_used():
    problem = materialise(make_case())
    used = problem.block_table[problem.block_table >= 0]
    assert problem.k_pages.shape[0] > len(set(used.tolist())) + 1
    assert 0 not in used


def test_block_table_is_wider_than_needed_and_padded_with_minus_one():
    problem = materialise(make_case(table_padding=5))
    needed = max(math.ceil(n / 4) for n in (10, 0, 7))
    assert problem.block_table.shape[1] == needed + 5
    assert (problem.block_table[:, needed:] == -1).all()
    assert (problem.block_table[1] == -1).all()  # the empty row holds no page


def test_pages_the_window_evicts_are_minus_one_inside_the_context():
    problem = materialise(make_case(context_lens=(30,), window=5, sinks=1))
    row = problem.block_table[0]
    kept_pages = set((kept_tokens(30, 5, 1) // 4).tolist())
    for page in range(math.ceil(30 / 4)):
        assert (row[page] >= 0) == (page in kept_pages)


def test_shared_pages_are_one_physical_page():
    problem = materialise(make_case(context_lens=(12, 9, 3), shared_pages=2))
    assert problem.block_table[1, :2].tolist() == problem.block_table[0, :2].tolist()
    assert problem.block_table[2, 0] != problem.block_table[0, 0]  # too short to share


def test_layout_seed_moves_pages_but_not_values():
    case = make_case()
    a, b = materialise(case, layout_seed=1), materialise(case, layout_seed=2)
    assert a.block_table.tolist() != b.block_table.tolist()
    for row in range(case.batch):
        for t in range(case.context_lens[row]):
            ka = a.k_pages[a.block_table[row, t // 4], t % 4]
            kb = b.k_pages[b.block_table[row, t // 4], t % 4]
            np.testing.assert_array_equal(ka, kb)


def test_values_follow_the_dtype_and_seed():
    case = make_case(dtype="bfloat16")
    assert materialise(case).q.dtype.name == "bfloat16"
    again = logical_kv(case)
    np.testing.assert_array_equal(logical_kv(case).q.astype(np.float32),
                                  again.q.astype(np.float32))
    other = logical_kv(replace(case, fixed_seed=case.seed + 1))  # another seed, other values
    assert not np.array_equal(other.q.astype(np.float32), again.q.astype(np.float32))
    assert other.q.shape == again.q.shape


@pytest.mark.parametrize("distribution,expect", [
    ("uniform", lambda lkv: np.all(lkv.q.astype(np.float32) == 0)),
    ("constant-v", lambda lkv: all(np.all(v == v[:1]) for v in lkv.values if len(v))),
])
def test_distributions_have_their_defining_property(distribution, expect):
    assert expect(logical_kv(make_case(distribution=distribution)))


def test_very_negative_and_large_scores_have_the_stated_magnitude():
    for distribution, low, high in (("very-negative", -2e5, -3e4), ("large", -1e5, 1e5)):
        case = make_case(distribution=distribution, head_dim=64)
        lkv = logical_kv(case)
        scores = np.einsum("hd,thd->th", lkv.q[0, ::2].astype(np.float64),
                           lkv.keys[0].astype(np.float64)) * case.scale
        assert low < scores.min() and scores.max() < high
        if distribution == "large":
            assert np.abs(scores).max() > 3e3


def test_poisoned_outputs():
    problem = materialise(make_case())
    out, lse = poisoned_outputs(problem, POISONS[1])
    assert out.dtype == problem.dtype and (out == POISONS[1]).all() and (lse == POISONS[1]).all()


def test_a_large_pool_puts_every_page_id_past_the_width_at_every_page_geometry():
    case = make_case(page_size=1, num_qo_heads=2, num_kv_heads=1, context_lens=(50, 3),
                     pool_pages=70000, fixed_seed=7)
    problem = materialise(case)
    used = problem.block_table[problem.block_table >= 0]
    assert problem.k_pages.shape[0] == 70000 and used.min() > 65535
    # a re-layout at another page size keeps the pool's elements, so offsets stay past too
    other = logical_kv(case).lay_out(4, 1)
    stride = 4 * 1 * 8
    assert other.k_pages.size == problem.k_pages.size
    assert other.block_table[other.block_table >= 0].min() * stride > 65535
    # and the answer is the same as in a small pool (the oracle reads what the table says)
    small = materialise(replace(case, pool_pages=0))
    np.testing.assert_array_equal(reference_of(problem)[0], reference_of(small)[0])
