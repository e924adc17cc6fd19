"""Which per-layer tensors are kept for backward, recomputed, or offloaded to host memory."""

from __future__ import annotations

from typing import Callable

import jax

from lctrain.parallel.model_arithmetic import BYTES
from lctrain.recipes.schema import REMAT_TENSORS, Recipe, RematConfig

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


def tpu_compiler_settings(remat: RematConfig) -> dict[str, tuple[str, str]]:
    """The remat keys set that are options of XLA's TPU compiler: recipe key -> (XLA
    option, value).

    remat.recast_weights turns off its bf16 propagation, which moves each layer's
    float32-to-bf16 weight cast in front of the layer loop's slicing and then out of the
    loop: one bf16 copy of all the layers' weights, alive from the first layer's forward
    to the last one's backward. remat.compiler_remat_percent sets the HBM share its own
    rematerialization pass works towards."""
    settings = {}
    if remat.recast_weights:
        settings["remat.recast_weights"] = ("xla_jf_bf16_propagation", "false")
    if remat.compiler_remat_percent is not None:
        settings["remat.compiler_remat_percent"] = (
            "xla_jf_rematerialization_percent_shared_memory_limit",
            str(remat.compiler_remat_percent))
    return settings


def compiler_options(recipe: Recipe, platform: str) -> dict[str, str]:
    """XLA options the train step compiles with: tpu_compiler_settings' on a TPU."""
    if platform != "tpu":
        return {}
    return dict(tpu_compiler_settings(recipe.remat).values())


# libtpu (0.0.42.1 and 0.0.50.1) aborts compiling a layer scan that offloads a piece of 4 GiB
# to host memory: "Check failed: index_space_.start <= index_space_.limit (0 vs. -1)" in its
# to-host DMA loop (EnqueueToHostIovaStridedDmaInGranulesRolledLoop), a 32-bit size wrapping
# to 0. 8 GiB aborts too; 6 GiB compiles, but such a wrapped count is not to be trusted
# with a run's gradients, and no chip has run one. So each piece stays under 4 GiB: the layer
# input is offloaded in slices of d_model where one piece would not.
OFFLOAD_PIECE_LIMIT = 2**32


def layer_input_pieces(recipe: Recipe, rows: int, tokens: int) -> int | None:
    """How many slices of d_model an offloaded layer input of `rows` x `tokens` per chip
    is named in (trainer/model/layer_scan.layer_input), the fewest that keep each under
    OFFLOAD_PIECE_LIMIT; 1 when the layer input is not offloaded; None if no slicing
    does."""
    if recipe.remat.tensors.get("decoder_layer_input") != "offload":
        return 1
    width = recipe.model.d_model
    whole = rows * tokens * width * BYTES[recipe.model.dtype]
    return next((pieces for pieces in range(1, width + 1)
                 if width % pieces == 0 and whole // pieces < OFFLOAD_PIECE_LIMIT), None)
