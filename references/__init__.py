"""Float64 oracles for paged decode attention and attention-state merging.

Written for clarity, never for speed; they import NumPy and nothing else, so every
backend is judged against the same plain definition.
"""

from conformance.references.decode import (
    alibi_slopes,
    decode_reference,
    kept_tokens,
    tree_visibility,
)
from conformance.references.merge import apply_sink, merge_reference

__all__ = ["alibi_slopes", "apply_sink", "decode_reference", "kept_tokens", "merge_reference",
           "tree_visibility"]
