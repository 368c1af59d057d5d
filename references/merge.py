"""The float64 log-sum-exp merge of two attention states over disjoint KV sets."""

from __future__ import annotations

import numpy as np


def merge_reference(o_a: np.ndarray, lse_a: np.ndarray, o_b: np.ndarray,
                    lse_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``.

    An empty state (LSE -inf) is the identity and two empty states merge to an empty state
    with output 0, never NaN.
    """
    o_a = np.asarray(o_a, dtype=np.float64)
    o_b = np.asarray(o_b, dtype=np.float64)
    lse_a = np.asarray(lse_a, dtype=np.float64)
    lse_b = np.asarray(lse_b, dtype=np.float64)
    lse = np.logaddexp(lse_a, lse_b)
    both_empty = np.isneginf(lse)
    safe = np.where(both_empty, 0.0, lse)
    w_a = np.where(both_empty, 0.0, np.exp(lse_a - safe))
    w_b = np.where(both_empty, 0.0, np.exp(lse_b - safe))
    out = w_a[..., None] * o_a + w_b[..., None] * o_b
    return out, lse
