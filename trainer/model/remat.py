"""Which per-layer tensors are kept for backward, recomputed, or offloaded to host memory."""

from __future__ import annotations

from typing import Callable

import jax

from lctrain.recipes.schema import REMAT_TENSORS, RematConfig

# Everything the layer computes with a weight matrix; what `minimal` keeps.
MATMUL_OUTPUTS = ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi",
                  "mlpwo")
assert set(MATMUL_OUTPUTS) <= set(REMAT_TENSORS)


def remat_policy(cfg: RematConfig) -> Callable | None:
    """A jax.checkpoint policy for the scanned layer; None means no remat at all."""
    if cfg.policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if cfg.policy == "minimal":
        return jax.checkpoint_policies.save_only_these_names(*MATMUL_OUTPUTS)
    if cfg.policy == "save_all":
        return None
    kept = [name for name, where in cfg.tensors.items() if where == "device"]
    offloaded = [name for name, where in cfg.tensors.items() if where == "offload"]
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=kept, names_which_can_be_offloaded=offloaded,
        offload_src="device", offload_dst="pinned_host")
