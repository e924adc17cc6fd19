"""The attention mask, derived only from token positions and segment ids.

Positions are true token positions, not array indices: a context-parallel
strategy may hand a kernel a reordered sequence (load balancing) or one chunk
of a longer sequence (a ring step). Building the mask from positions and
segment ids alone keeps every kernel correct under all of those layouts.
"""

import jax


def attention_mask(q_positions: jax.Array, kv_positions: jax.Array,
                   q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                   causal: bool) -> jax.Array:
    """Boolean [..., sq, skv]: query i may attend key j.

    Allowed iff both tokens belong to the same segment (document) and, when
    causal, the key does not come after the query in the original sequence.
    Leading (batch) dims of the four inputs must broadcast.
    """
    allowed = q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]
    if causal:
        allowed = allowed & (q_positions[..., :, None] >= kv_positions[..., None, :])
    return allowed

