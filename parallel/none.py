"""No context parallelism: every device holds whole sequences (mesh.context == 1)."""

from __future__ import annotations

from lctrain.parallel.strategy import ContextStrategy


class NoContextParallel(ContextStrategy):
    name = "none"

    def local_attention(self, q, k, v, positions, segment_ids):
        return self.kernel(q, k, v, positions, positions, segment_ids, segment_ids)
