"""The attention mask, derived only from token positions and segment ids.

Positions are true token positions, not array indices: a context-parallel
strategy may hand a kernel a reordered sequence (load balancing) or one chunk
of a longer sequence (a ring step). Building the mask from positions and
segment ids alone keeps every kernel correct under all of those layouts.

Sliding window (Mistral / Gemma, as in transformers): with `window` w a query
also sees only keys fewer than w positions behind it, q_pos - kv_pos < w (itself
included, so w keys at most). Positions restart per packed document, or are
sequence indices with documents kept apart by segment ids: either way the
difference is the distance within the document, so the window is per document.
"""

import jax


def check_window(window: int | None) -> None:
    """ValueError unless `window` is None (global attention) or a positive int."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"attention window must be a positive int or None (global), "
                         f"got {window!r}")


def pair_allowed(q_pos, kv_pos, q_seg, kv_seg, causal: bool, window: int | None = None):
    """Elementwise rule, broadcasting its operands (the kernels pass a column of queries
    and a row of keys, or the reverse): same segment, and if causal the key not after
    the query, and with a window the key fewer than `window` positions behind it."""
    allowed = q_seg == kv_seg
    if causal:
        allowed = allowed & (q_pos >= kv_pos)
    if window is not None:
        allowed = allowed & (q_pos - kv_pos < window)
    return allowed


def attention_mask(q_positions: jax.Array, kv_positions: jax.Array,
                   q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                   causal: bool, window: int | None = None) -> jax.Array:
    """Boolean [..., sq, skv]: query i may attend key j (`pair_allowed`).

    Leading (batch) dims of the four inputs must broadcast.
    """
    return pair_allowed(q_positions[..., :, None], kv_positions[..., None, :],
                        q_segment_ids[..., :, None], kv_segment_ids[..., None, :],
                        causal, window)
