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

The same rule decides which blocks a kernel or a ring step visits: for a block of queries
and a block of keys, each known by its lowest and highest position, whether some pair may
be allowed and whether every pair is (`some_keys_visible`, `every_key_visible`), and
whether their documents may meet at all (`some_segments_shared`). The element rule is
that block rule for one-token blocks. The Pallas schedule, the splash block map, the GPU
kernel and the ring's step skipping all call these.
"""

import jax


def check_window(window: int | None) -> None:
    """ValueError unless `window` is None (global attention) or a positive int."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"attention window must be a positive int or None (global), "
                         f"got {window!r}")


def some_keys_visible(q_lo, q_hi, kv_lo, kv_hi, causal: bool, window: int | None = None):
    """By position alone (segments aside): whether some query in [q_lo, q_hi] may see some
    key in [kv_lo, kv_hi], judged by the nearest pair. False means the block pair can be
    skipped. Broadcasts, and works on scalars read from SMEM inside a kernel (True, a
    Python bool, when the attention is neither causal nor windowed)."""
    visible = True
    if causal:
        visible = visible & (q_hi >= kv_lo)
    if window is not None:
        visible = visible & (q_lo - kv_hi < window)
    return visible


def every_key_visible(q_lo, q_hi, kv_lo, kv_hi, causal: bool, window: int | None = None):
    """By position alone: whether every query in [q_lo, q_hi] sees every key in
    [kv_lo, kv_hi]. True means the pair needs no positional mask. The farthest pair
    decides: the same rule with each side's bounds swapped."""
    return some_keys_visible(q_hi, q_lo, kv_hi, kv_lo, causal, window)


def some_segments_shared(q_seg_lo, q_seg_hi, kv_seg_lo, kv_seg_hi):
    """Whether a block of queries with segment ids in [q_seg_lo, q_seg_hi] and a block of
    keys with ids in [kv_seg_lo, kv_seg_hi] may hold a pair of the same document: their
    ranges overlap. Broadcasts, and works on SMEM scalars."""
    return (q_seg_lo <= kv_seg_hi) & (kv_seg_lo <= q_seg_hi)


def pair_allowed(q_pos, kv_pos, q_seg, kv_seg, causal: bool, window: int | None = None):
    """Elementwise rule, broadcasting its operands (the kernels pass a column of queries
    and a row of keys, or the reverse): same segment, and if causal the key not after
    the query, and with a window the key fewer than `window` positions behind it."""
    return (q_seg == kv_seg) & every_key_visible(q_pos, q_pos, kv_pos, kv_pos, causal, window)


def attention_mask(q_positions: jax.Array, kv_positions: jax.Array,
                   q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                   causal: bool, window: int | None = None) -> jax.Array:
    """Boolean [..., sq, skv]: query i may attend key j (`pair_allowed`).

    Leading (batch) dims of the four inputs must broadcast.
    """
    return pair_allowed(q_positions[..., :, None], kv_positions[..., None, :],
                        q_segment_ids[..., :, None], kv_segment_ids[..., None, :],
                        causal, window)
