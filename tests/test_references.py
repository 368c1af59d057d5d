"""The oracle against an independent brute-force formulation and hand-worked cases."""

import math

import numpy as np
import pytest

from conformance.references import decode_reference, kept_tokens, merge_reference, tree_visibility


def brute_force(q, k_pages, v_pages, table, lens, sm_scale, window=None, sinks=0,
                query_lens=None, masks=None):
    """Token by token with plain Python floats: a second reading of docs/design.md §3. Query
    row by query row: ``query_lens[b]`` rows per sequence (one each by default), the last
    positions of its context; ``masks[b][t][i]``: draft ``t`` sees draft ``i`` (causal when
    None)."""
    _, hq, d = q.shape
    hkv = k_pages.shape[2]
    page_size = k_pages.shape[1]
    query_lens = [1] * len(lens) if query_lens is None else query_lens
    out = np.zeros((len(q), hq, d))
    lse = np.full((len(q), hq), -math.inf)
    row = -1
    for b in range(len(lens)):
        n, m = int(lens[b]), int(query_lens[b])
        for t in range(m):
            row += 1
            here = n - m + t
            seen = here + 1 if masks is None or masks[b] is None else n
            tokens = [j for j in range(seen)
                      if (j < n - m or masks is None or masks[b] is None or masks[b][t][j - n + m])
                      and (window is None or j > here - window or j < sinks)]
            for h in range(hq):
                kv = h // (hq // hkv)
                scores = []
                for j in tokens:
                    key = k_pages[int(table[b][j // page_size]), j % page_size, kv]
                    scores.append(sm_scale * sum(float(x) * float(y)
                                                 for x, y in zip(q[row, h], key, strict=True)))
                if not scores:
                    continue
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for j, w in zip(tokens, weights, strict=True):
                    value = v_pages[int(table[b][j // page_size]), j % page_size, kv]
                    out[row, h] += w / total * value.astype(np.float64)
                lse[row, h] = top + math.log(total)
    return out, lse


def random_paged(rng, lens, hq, hkv, d, page_size):
    pages_needed = sum(math.ceil(n / page_size) for n in lens)
    pool = pages_needed + 3
    order = rng.permutation(pool)
    table = -np.ones((len(lens), max(math.ceil(n / page_size) for n in lens) + 2), np.int32)
    used = 0
    for b, n in enumerate(lens):
        for j in range(math.ceil(n / page_size)):
            table[b, j] = order[used]
            used += 1
    k = rng.standard_normal((pool, page_size, hkv, d))
    v = rng.standard_normal((pool, page_size, hkv, d))
    q = rng.standard_normal((len(lens), hq, d))
    return q, k, v, table, np.array(lens, np.int32)


@pytest.mark.parametrize("lens,hq,hkv,page_size,window,sinks", [
    ([5, 0, 19], 4, 2, 4, None, 0),
    ([1, 33], 6, 1, 8, None, 0),
    ([30, 7, 16], 3, 3, 5, 6, 0),
    ([40, 12], 8, 2, 4, 5, 3),
    ([9], 7, 7, 1, 20, 2),
])
def test_oracle_matches_brute_force(lens, hq, hkv, page_size, window, sinks):
    rng = np.random.default_rng(sum(lens) + hq)
    q, k, v, table, ctx = random_paged(rng, lens, hq, hkv, 6, page_size)
    got = decode_reference(q, k, v, table, ctx, sm_scale=0.37, window=window, sinks=sinks)
    want = brute_force(q, k, v, table, ctx, 0.37, window, sinks)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
    finite = np.isfinite(want[1])
    np.testing.assert_allclose(got[1][finite], want[1][finite], rtol=1e-12)


@pytest.mark.parametrize("lens,query_lens,parents,window,sinks", [
    ([9, 4, 17], [3, 1, 4], None, None, 0),  # causal, ragged, a one-token row between
    ([9, 4, 17], [3, 1, 4], [[-1, 0, 0], None, [-1, 0, 1, 1]], None, 0),  # trees
    ([12, 5], [4, 5], [[-1, -1, 1, 2], [-1, 0, 1, 2, 3]], 3, 1),  # window inside the drafts
    ([6, 0], [6, 1], [[-1, 0, 0, 2, 2, 0], None], 2, 0),  # queries only; an empty row
    ([8, 3], [3, 2], ["all", "all"], None, 0),  # every draft sees every draft, later ones too
])
def test_several_query_tokens_match_brute_force(lens, query_lens, parents, window, sinks):
    rng = np.random.default_rng(sum(lens))
    _, k, v, table, ctx = random_paged(rng, lens, 4, 2, 6, 4)
    q = rng.standard_normal((sum(query_lens), 4, 6))
    masks = None if parents is None else [
        None if p is None else np.ones((m, m), bool) if p == "all" else tree_visibility(p)
        for p, m in zip(parents, query_lens, strict=True)]
    got = decode_reference(q, k, v, table, ctx, sm_scale=0.37, window=window, sinks=sinks,
                           query_lens=np.array(query_lens), draft_mask=packed(masks, query_lens))
    want = brute_force(q, k, v, table, ctx, 0.37, window, sinks, query_lens, masks)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    finite = np.isfinite(want[1])
    np.testing.assert_array_equal(np.isfinite(got[1]), finite)
    np.testing.assert_allclose(got[1][finite], want[1][finite], rtol=1e-12)


def test_a_causal_draft_is_the_one_token_decode_of_its_own_prefix():
    rng = np.random.default_rng(3)
    _, k, v, table, ctx = random_paged(rng, [10], 4, 2, 6, 4)
    q = rng.standard_normal((4, 4, 6))
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    drafts = decode_reference(q, k, v, table, ctx, sm_scale=0.4, window=5, sinks=1,
                              alibi_slopes=slopes, query_lens=np.array([4]))
    for t in range(4):
        alone = decode_reference(q[t:t + 1], k, v, table, np.array([7 + t], np.int32),
                                 sm_scale=0.4, window=5, sinks=1, alibi_slopes=slopes)
        np.testing.assert_allclose(drafts[0][t], alone[0][0], rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(drafts[1][t], alone[1][0], rtol=1e-13)


def packed(masks: list, query_lens: list[int]) -> np.ndarray | None:
    """Per-sequence visibilities (None: causal) as the oracle takes them, one row a token."""
    if masks is None or all(m is None for m in masks):
        return None
    rows = [np.tri(n, dtype=bool) if m is None else m for m, n in zip(masks, query_lens,
                                                                      strict=True)]
    out = np.zeros((sum(query_lens), max(query_lens)), dtype=bool)
    start = 0
    for m in rows:
        out[start:start + len(m), :len(m)] = m
        start += len(m)
    return out


def test_tree_visibility_is_ancestry_and_a_chain_is_causal():
    np.testing.assert_array_equal(tree_visibility([-1, 0, 1, 2]), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(tree_visibility([-1, 0, 0, 1]), np.array(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool))
    with pytest.raises(ValueError, match=r"parents\[2\] = 2"):
        tree_visibility([-1, 0, 2])


def one_page(keys, values):
    """A single sequence in one page, one head: (q shape (1,1,d) given by the caller)."""
    k = np.asarray(keys, np.float64)[None, :, None, :]
    v = np.asarray(values, np.float64)[None, :, None, :]
    return k, v, np.array([[0]], np.int32), np.array([len(keys)], np.int32)


def test_single_token_returns_its_value_and_score():
    k, v, table, lens = one_page([[2.0, 0.0]], [[5.0, -1.0]])
    out, lse = decode_reference(np.array([[[1.5, 3.0]]]), k, v, table, lens, sm_scale=1.0)
    assert out.tolist() == [[[5.0, -1.0]]]
    assert lse[0, 0] == pytest.approx(3.0)


def test_two_tokens_weighted_one_to_three():
    # scores 0 and ln 3 -> weights 1/4 and 3/4; LSE = log(1 + 3)
    k, v, table, lens = one_page([[0.0], [math.log(3)]], [[4.0], [8.0]])
    out, lse = decode_reference(np.array([[[1.0]]]), k, v, table, lens, sm_scale=1.0)
    assert out[0, 0, 0] == pytest.approx(0.25 * 4 + 0.75 * 8)
    assert lse[0, 0] == pytest.approx(math.log(4))


def test_empty_context_is_zero_and_minus_infinity():
    k, v, table, _ = one_page([[1.0]], [[1.0]])
    out, lse = decode_reference(np.array([[[1.0]]]), k, v, table, np.array([0], np.int32),
                                sm_scale=1.0)
    assert out.tolist() == [[[0.0]]] and lse[0, 0] == -math.inf


def test_window_and_sinks_keep_the_documented_tokens():
    assert kept_tokens(10, None, 0).tolist() == list(range(10))
    assert kept_tokens(10, 3, 0).tolist() == [7, 8, 9]
    assert kept_tokens(10, 3, 2).tolist() == [0, 1, 7, 8, 9]
    assert kept_tokens(4, 10, 2).tolist() == [0, 1, 2, 3]
    assert kept_tokens(0, 3, 2).tolist() == []


def test_minus_one_inside_what_must_be_read_is_an_error():
    k, v, _, lens = one_page([[1.0], [2.0]], [[1.0], [2.0]])
    with pytest.raises(ValueError, match="-1"):
        decode_reference(np.ones((1, 1, 1)), k, v, np.array([[-1]], np.int32), lens,
                         sm_scale=1.0)


def test_merge_by_hand():
    out, lse = merge_reference(np.array([[[2.0]]]), np.array([[0.0]]),
                               np.array([[[6.0]]]), np.array([[math.log(3)]]))
    assert out[0, 0, 0] == pytest.approx(0.25 * 2 + 0.75 * 6)
    assert lse[0, 0] == pytest.approx(math.log(4))


def test_merge_of_halves_equals_the_whole():
    rng = np.random.default_rng(3)
    q, k, v, table, lens = random_paged(rng, [12], 2, 1, 4, 4)
    whole = decode_reference(q, k, v, table, lens, sm_scale=0.5)
    first = decode_reference(q, k, v, table, np.array([5], np.int32), sm_scale=0.5)
    # the second half as its own sequence: tokens 5..11 moved to a fresh table
    tokens = np.arange(5, 12)
    k2 = k[table[0, tokens // 4], tokens % 4][None, :, :, :]
    v2 = v[table[0, tokens // 4], tokens % 4][None, :, :, :]
    second = decode_reference(q, k2, v2, np.array([[0]], np.int32), np.array([7], np.int32),
                              sm_scale=0.5)
    merged = merge_reference(*first, *second)
    np.testing.assert_allclose(merged[0], whole[0], rtol=1e-12)
    np.testing.assert_allclose(merged[1], whole[1], rtol=1e-12)


def test_merge_with_empty_is_identity_and_two_empties_stay_empty():
    o = np.array([[[1.5, -2.0]]])
    empty_o, empty_lse = np.zeros_like(o), np.array([[-np.inf]])
    out, lse = merge_reference(o, np.array([[0.7]]), empty_o, empty_lse)
    assert out.tolist() == o.tolist() and lse[0, 0] == 0.7
    out, lse = merge_reference(empty_o, empty_lse, empty_o, empty_lse)
    assert out.tolist() == [[[0.0, 0.0]]] and lse[0, 0] == -np.inf


def test_low_precision_recomputation_has_larger_error_than_float64():
    rng = np.random.default_rng(5)
    q, k, v, table, lens = random_paged(rng, [300], 2, 1, 64, 16)
    exact = decode_reference(q, k, v, table, lens, sm_scale=0.125)
    low = decode_reference(q, k, v, table, lens, sm_scale=0.125, precision=np.float16)
    error = np.abs(low[0] - exact[0]).max()
    assert 1e-5 < error < 1e-1
