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


def apply_sink(out: np.ndarray, lse: np.ndarray, sink_logits: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """A state over some tokens with a sink logit per head joined once: the denominator
    gains ``exp(z_h)`` (``out * sigmoid(lse - z)``, ``lse = logaddexp(lse, z)``). An empty
    state (LSE -inf) stays output 0 and gets LSE ``z``."""
    out64, lse64 = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    sink = np.broadcast_to(np.asarray(sink_logits, np.float64), lse64.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        merged = np.logaddexp(lse64, sink)
        keep = np.where(np.isneginf(merged), 0.0, np.exp(lse64 - merged))
    return out64 * keep[..., None], merged
