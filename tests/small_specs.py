"""Small cases and one-family spec documents, for the tests of one spec field at a time."""

from __future__ import annotations

from conformance.spec import Case


def small_case(**fields) -> Case:
    """A three-row case of 4/2 heads, head_dim 16, pages of 4 (an empty middle row)."""
    base = dict(family="t", num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                dtype="float32", context_lens=(30, 0, 7))
    return Case(**{**base, **fields})


def one_family_spec(**fields) -> dict:
    """A parsed-TOML spec of one family ``f`` in one profile ``p``: 4/2 heads, head_dim 16,
    pages of 4, one row of 5 tokens, float32, and ``fields`` over that."""
    family = {"name": "f", "profiles": ["p"], "set": {
        "num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 16, "page_size": 4,
        "context_lens": [5], "dtypes": ["float32"], **fields}}
    return {"profiles": {"p": {}}, "family": [family]}
