"""Float64 oracles for paged decode attention and attention-state merging.

Written for clarity, never for speed; they import NumPy and nothing else, so every
backend is judged against the same plain definition.
"""

from references.decode import decode_reference, kept_tokens
from references.merge import merge_reference

__all__ = ["decode_reference", "kept_tokens", "merge_reference"]
