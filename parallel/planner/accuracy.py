"""Where the memory estimate is known not to follow XLA, in the plan's own words.

From the compiled grid in benchmarks/data/planner_grid.jsonl (llama3.1-8b, the four
strategies; full remat, the layer inputs offloaded, and offloaded with the MLP in chunks;
128K-8M tokens; `python benchmarks/refit_planner.py` prints it): on 4 chips every point
lies within 10% of XLA's per-chip HBM up to 128K tokens per chip. At 256K tokens per
chip the estimate runs 10-23% high with the layer inputs offloaded and the MLP whole (the
4-chip points recompiled after trainer/model.gradients_together, which stopped the MLP's
intermediates outliving its backward: three points over 15%), and within 8% with the MLP
in chunks (recipes/llama3_8b_1m.yaml: ring 2.5% high, ulysses 4.9% low, usp 7.2% high,
all_gather 5.3% high). On 64 chips ring follows within 10%, but XLA's figure moves where
no formula of the code follows it for usp with a Ulysses degree above the KV heads (32
over 8; offloaded 10.0, 19.2, 21.1, 39.4 GB at 1M, 2M, 4M, 8M tokens, the estimate from
25% under it at 2M to 12% over it at 4M) and for all_gather (its full-remat programs keep
0.7-1.7 layer-input stacks; at 8M tokens offloaded XLA squeezes the program to 91 GB,
under the chip's HBM, and the estimate runs 22% over it).

A model whose scan picks each layer's kind with a switch (global and sliding layers,
recipes/gemma3_like_8b_1m.yaml at 1M tokens on v5p:2x2x1, its sliding layers on halo;
`plan --compile`): the estimate ran 3.2% under XLA with all_gather on the global layers,
7.1% under with ring, 4.3% over with usp (2 x 2) and 17.5% under with ulysses, whose
all-to-alls inside the switch cost about 12 GB more than in a model of global layers alone
(84.46 GB against 72.30 GB compiled).
"""

from __future__ import annotations

import math

from lctrain.recipes.schema import Recipe

# The most chips, and the most tokens per chip, where every strategy's estimate stayed
# within 10% of the compiled figure.
CHIPS_FOLLOWED = 4
TOKENS_PER_CHIP_FOLLOWED = 131072


def estimate_note(recipe: Recipe, axis_sizes: dict[str, int]) -> str | None:
    """A warning for a plan outside what the estimate follows; None inside it."""
    chips = math.prod(axis_sizes.values())
    tokens_per_chip = recipe.data.seq_len // axis_sizes["context"]
    reasons = []
    if chips > CHIPS_FOLLOWED:
        reasons.append("on 64 chips usp with a Ulysses degree above the KV heads ran from "
                       "25% under XLA's figure to 12% over it, all_gather from 11% under "
                       "to 22% over (8M tokens, where XLA squeezes the program under the "
                       "chip's HBM)")
    if tokens_per_chip > TOKENS_PER_CHIP_FOLLOWED:
        reasons.append(f"at {tokens_per_chip // 1024}K tokens per chip the estimate ran up "
                       f"to 23% high with the MLP whole, and within 8% with the MLP in "
                       f"chunks (recipes/llama3_8b_1m.yaml: ring 2.5% high, usp 7.2% high)")
    if recipe.model.switches_layer_kinds():
        reasons.append("with global and sliding layers (recipes/gemma3_like_8b_1m.yaml at "
                       "1M tokens on 4 chips) it ran 3-7% under XLA's figure with "
                       "all_gather, ring or usp on the global layers, and 17.5% under with "
                       "ulysses")
    if not reasons:
        return None
    return ("the memory estimate is rough here: on the compiled grid "
            "(benchmarks/data/planner_grid.jsonl) " + "; ".join(reasons)
            + "; use --compile for XLA's own figure")
