"""No context parallelism: every device holds whole sequences (mesh.context == 1)."""

from __future__ import annotations

from lctrain.parallel.all_gather import gathered_attention_footprint
from lctrain.parallel.cost_model import AttentionFootprint, Dims, NotOnThisMesh, Traffic
from lctrain.parallel.strategy import ContextStrategy
from lctrain.recipes.schema import Recipe


class NoContextParallel(ContextStrategy):
    name = "none"
    simplicity = 0

    def local_attention(self, q, k, v, positions, segment_ids, window=None):
        return self.kernel(q, k, v, positions, positions, segment_ids, segment_ids,
                           window=window)

    @classmethod
    def planned_ulysses_degree(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> int:
        if axis_sizes["context"] != 1:
            raise NotOnThisMesh(f"mesh.context is {axis_sizes['context']}")
        return 1

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        """all_gather's, with nothing to gather: the device's chunk is the sequence."""
        return gathered_attention_footprint(dm)

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        return {}
