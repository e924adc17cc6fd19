"""Remat policies that keep attention's results ('context') spare its forward kernels in
backward: the gradient's jaxpr, after dead-code elimination, is searched for the Pallas
forward kernel inside the scanned layer's recomputation."""

from __future__ import annotations

import jax
import pytest

from lctrain.kernels.jaxpr_walk import subprograms
from lctrain.recipes import load_recipe
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import build_trainable


def pallas_kernels(jaxpr, in_backward=False):
    """(kernel name, inside the backward's recomputation) for every pallas_call."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            name = eqn.params.get("name_and_src_info", eqn.params.get("name"))
            found.append((str(name).split()[0], in_backward))
            continue
        for inner in subprograms(eqn):
            found += pallas_kernels(inner, in_backward or eqn.primitive.name == "remat2")
    return found


def forward_kernels_in_backward(sets: list[str]) -> int:
    """Attention forward kernels the backward of one layer runs (the scanned layer's
    `remat2` recomputation), in the gradient's jaxpr after dead-code elimination (what jit
    lowers; call sites, so a ring's peeled last step counts twice): 0 when the policy kept
    attention's results."""
    from jax._src.interpreters.partial_eval import dce_jaxpr

    from lctrain.parallel import make_strategy
    from lctrain.trainer.data.sources import make_source
    from lctrain.trainer.state.build import device_batch
    from lctrain.trainer.state.step import make_loss_sums

    recipe = load_recipe("tiny", ["attention.impl=pallas", "data.seq_len=256", *sets])
    mesh = mesh_for(recipe)
    strategy = make_strategy(recipe, mesh)
    trainable = build_trainable(recipe, mesh)
    loss_sums = make_loss_sums(recipe, trainable.graphdef, strategy)
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=0)
    batch = device_batch(source, 0, strategy.sequence_order(recipe.data.seq_len), mesh)
    grad = jax.grad(lambda params, batch: loss_sums(params, batch)[0])
    jaxpr = jax.make_jaxpr(grad)(trainable.abstract_state.params, batch).jaxpr
    jaxpr, _ = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    kernels = pallas_kernels(jaxpr)
    assert {name for name, in_backward in kernels if in_backward} >= {"lctrain_flash_backward"}
    return sum(name == "lctrain_flash_forward" and in_backward for name, in_backward in kernels)


@pytest.mark.parametrize("strategy", [["parallel.strategy=none"],
                                      ["parallel.strategy=ring", "mesh.context=4"]])
@pytest.mark.parametrize("policy, reruns", [
    (["remat.policy=full"], True), (["remat.policy=minimal"], False),
    (["remat.policy=custom", "remat.tensors={context: device}"], False),
    (["remat.policy=custom", "remat.tensors={out_proj: device}"], True)])
def test_kept_context_means_no_attention_forward_in_backward(strategy, policy, reruns):
    """out and logsumexp are named 'context' inside the kernels' (and ring's) forward
    rules; a name on the output outside them would leave lse unnamed, and every policy
    would re-run attention's forward to get it back. (context: offload is left out: jax
    then recomputes the kernels' residuals unless the strategy is ring.)"""
    assert (forward_kernels_in_backward(strategy + policy) > 0) == reruns
