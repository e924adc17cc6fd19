"""No context parallelism: every device sees whole sequences (mesh.context == 1)."""

from __future__ import annotations

from lctrain import kernels
from lctrain.parallel.strategy import ContextStrategy


class NoContextParallel(ContextStrategy):
    name = "none"

    def attend(self, q, k, v, positions, segment_ids):
        return kernels.attention(q, k, v, q_positions=positions, kv_positions=positions,
                                 q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                 causal=True, **self.kernel_options)
