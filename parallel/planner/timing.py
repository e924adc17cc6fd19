"""How long a step's compute and traffic take, and which traffic the step waits for.

Time: compute = (6 x parameters + 6 L s h d_head / 2) flops per token
(parallel/model_arithmetic.py) plus what remat recomputes, at the chip's bf16 peak; each
collective kind at the link bandwidth (one link for the ring's one-way sends, two for XLA's
bidirectional rings), the part that crosses slices (traffic.DCN sources) at the chip's
share of DCN bandwidth. The weight gathers, gradient reductions and loss-head traffic can
overlap the compute; the strategy's own gathers / all-to-alls cannot (attention waits for
them), nor the part of a ring send that outlasts its step's attention. Step = max(compute,
overlappable traffic) + exposed traffic; the ring adds its memory-bound merges at HBM
bandwidth. MFU bound = model flops / (peak x step).
"""

from __future__ import annotations

import dataclasses
import math

from lctrain.parallel.chips import Chip
from lctrain.parallel.cost_model import RING_SENDS, RingTiming, Traffic
from lctrain.parallel.model_arithmetic import (attention_forward_flops_per_token,
                                               count_parameters, training_flops_per_token)
from lctrain.parallel.planner.shapes import checkpoint_shares, loss_chunks
from lctrain.parallel.planner.traffic import DCN
from lctrain.recipes.schema import Recipe


@dataclasses.dataclass(frozen=True)
class Timing:
    """StrategyPlan's time fields (the same names and meanings)."""
    compute_s: float
    comm_s: float
    exposed_s: float
    model_flops: float
    ring_hidden: bool | None


def timing(recipe: Recipe, axis_sizes: dict[str, int], chip: Chip, detail: Traffic,
           own: Traffic, ring: RingTiming | None) -> Timing:
    """The step's times from its traffic (`detail`, by source), of which `own` is the
    strategy's, and the strategy's ring (None without one)."""
    flops = _flops_per_device(recipe, axis_sizes)
    compute_s = flops["hardware"] / chip.peak_bf16_flops
    seconds = {source: nbytes / _bandwidth(chip, kind, source.endswith(DCN))
               for source, (kind, nbytes) in detail.items()}
    comm_s = sum(seconds.values())
    # On the critical path: the strategy's gathers and all-to-alls (attention waits for
    # them); the ring's sends only where a step's send outlasts the step's attention.
    exposed_s = sum(t for source, t in seconds.items() if source in own and source != RING_SENDS)
    hidden = None
    if ring is not None:
        hidden = ring.work_over_send >= 1
        exposed_s += seconds[RING_SENDS] * max(0.0, 1 - ring.work_over_send)
        compute_s += ring.merge_seconds
    return Timing(compute_s, comm_s, exposed_s, flops["model"], hidden)


def _bandwidth(chip: Chip, kind: str, across_slices: bool = False) -> float:
    """Bytes/s one device receives for a collective kind: the ring's collective-permute
    uses one link (one direction); XLA's all-gather, reduce-scatter, all-reduce and
    all-to-all run bidirectional rings, two links. Across slices: the device's share of
    its host's DCN bandwidth."""
    if across_slices:
        if chip.dcn_bytes_per_s is None:
            raise ValueError(f"no DCN bandwidth known for {chip.name} (parallel/chips.py), "
                             f"so a multi-slice step cannot be timed")
        return chip.dcn_bytes_per_s
    links = 1 if kind == "collective-permute" else min(2, chip.links)
    return chip.link_bytes_per_s * links


def _flops_per_device(recipe: Recipe, axis_sizes: dict[str, int]) -> dict:
    """Model flops (model_arithmetic.training_flops_per_token, as the run's MFU counts them)
    and hardware flops (plus what remat recomputes) per device per step."""
    m = recipe.model
    devices = math.prod(axis_sizes.values())
    tokens = recipe.data.batch_size * recipe.data.seq_len
    params = count_parameters(recipe.model)
    attention_fwd = attention_forward_flops_per_token(m, recipe.data.seq_len)
    model = tokens * training_flops_per_token(m, recipe.data.seq_len)
    extra = 0
    layer_params = params - m.vocab * m.d_model * (1 if m.tie_embeddings else 2) - m.d_model
    if recipe.remat.policy in ("full",):
        extra = tokens * (2 * layer_params + attention_fwd)
    elif recipe.remat.policy in ("minimal", "custom"):
        extra = tokens * attention_fwd
    _, recomputed = checkpoint_shares(m.layers, recipe.remat.layers_per_checkpoint)
    extra += tokens * (2 * layer_params + attention_fwd) * recomputed
    n_chunks = loss_chunks(recipe, axis_sizes["context"])[0]
    if n_chunks > 1:        # the chunked loss recomputes each chunk's logits in backward
        extra += tokens * 2 * m.d_model * m.vocab
    return {"model": model / devices, "hardware": (model + extra) / devices}
