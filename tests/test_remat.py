"""Remat policies and host offload: what the TPU compiler reports per chip (slow, libtpu
ahead-of-time), and on CPU that offloading changes no number of training.

The AOT cases compile one small model (4 x v5p, data parallel) where the layer inputs the
scan saves for backward are a large part of the memory, so moving them shows in the totals:

    tokens per chip  T = batch 8 x seq 512 / 4 devices = 1024
    layer inputs     E = layers 64 x T x d_model 128 x 2 bytes (bf16) = 16 MiB

`full` keeps E on the device (the scan saves its carry whatever the policy says);
`custom` with decoder_layer_input: offload keeps E in pinned host memory instead.
Device memory is compared with `peak_memory_in_bytes` (arguments + the temporaries live at
the worst moment: it falls by about E here); `temp_size_in_bytes`, the size of the
temporaries' allocation, falls by more than E, so it is only bounded below. (The compile
time grows with the tokens, not the layers: many layers and few tokens per chip keep E a
large part of the memory at a small compile.)
"""

from __future__ import annotations

import functools
import math
import re
import shutil

import jax
import pytest
from rich.console import Console

from lctrain.parallel.model_arithmetic import count_parameters, parameter_tensors
from lctrain.recipes import load_recipe
from lctrain.trainer.state.device_checks import check_devices, check_host_memory
from lctrain.recipes.schema import RecipeError
from lctrain.trainer.model.remat import compiler_options
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import build_trainable
from lctrain.trainer.train.loop import train
from helpers import one_worker
from tpu_aot import needs_libtpu

shares_compiles = one_worker("test_remat_aot")  # the tests that share a compiled case

TOPOLOGY = "v5p:2x2x1"
DEVICES = 4
LAYERS, D_MODEL, SEQ_LEN, BATCH = 64, 128, 512, 8
AOT_SETS = ["runtime.cpu_devices=0", "model.preset=tiny", f"model.layers={LAYERS}",
            f"model.d_model={D_MODEL}", "model.n_heads=2", "model.n_kv_heads=1",
            "model.dtype=bfloat16", f"data.seq_len={SEQ_LEN}", f"data.batch_size={BATCH}",
            "mesh.data=4", "attention.impl=xla"]
TOKENS_PER_CHIP = BATCH * SEQ_LEN // DEVICES
LAYER_INPUTS = LAYERS * TOKENS_PER_CHIP * D_MODEL * 2           # 16,777,216 = 16 MiB
CASES = {
    "full": ["remat.policy=full"],
    "minimal": ["remat.policy=minimal"],
    "offload": ["remat.policy=custom", "remat.tensors={decoder_layer_input: offload}"],
    "opt_offload": ["remat.policy=full", "optimizer.offload=true"],
    # Gemma 3's pattern: the scan steps over layers of two kinds (a switch per step).
    "mixed_offload": ["remat.policy=custom", "remat.tensors={decoder_layer_input: offload}",
                      "model.layer_pattern=[{kind: sliding, count: 5, window: 256}, "
                      "{kind: global, count: 1}]"],
    "offload_every_2": ["remat.policy=custom", "remat.tensors={decoder_layer_input: offload}",
                        "remat.layers_per_checkpoint=2"],
    "recast": ["remat.policy=full", "remat.recast_weights=true"],
}


@functools.cache
def compiled(case: str):
    """(memory_analysis(), optimized HLO text) of the AOT case."""
    from lctrain.parallel import aot
    from lctrain.trainer.state import build
    recipe = load_recipe("tiny", AOT_SETS + CASES[case])
    program = build.compile_train_step(recipe, aot.topology_devices(TOPOLOGY))
    memory = program.memory_analysis()
    print(f"\n{case}: peak {memory.peak_memory_in_bytes:,} temp {memory.temp_size_in_bytes:,} "
          f"host temp {memory.host_temp_size_in_bytes:,} arguments "
          f"{memory.argument_size_in_bytes:,} host arguments "
          f"{memory.host_argument_size_in_bytes:,} (E {LAYER_INPUTS:,})")
    return memory, program.as_text()


def stacked_layer_input_spaces(hlo: str) -> set[str]:
    """Memory spaces of the [layers, b, s, d_model] buffer the scan saves: '' for device
    HBM, 'S(5)' for pinned host (XLA TPU's memory-space annotation in the layout)."""
    shape = rf"bf16\[{LAYERS},{BATCH // DEVICES},{SEQ_LEN},{D_MODEL}\]\{{([^}}]*)\}}"
    return {("S(5)" if "S(5)" in layout else "") for layout in re.findall(shape, hlo)}


def close(actual: int, expected: int, tolerance: float = 0.1) -> bool:
    return abs(actual - expected) <= tolerance * expected


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_offloading_the_layer_input_moves_it_to_host_memory():
    full, full_hlo = compiled("full")
    minimal, _ = compiled("minimal")
    offload, offload_hlo = compiled("offload")
    assert full.host_temp_size_in_bytes == 0
    assert minimal.host_temp_size_in_bytes == 0
    # The saved layer inputs, and nothing else, live in host memory ...
    assert close(offload.host_temp_size_in_bytes, LAYER_INPUTS), offload.host_temp_size_in_bytes
    assert stacked_layer_input_spaces(full_hlo) == {""}
    assert stacked_layer_input_spaces(offload_hlo) == {"S(5)"}
    # ... and leave the device: its peak drops by that much, its temporaries by at least.
    drop = full.peak_memory_in_bytes - offload.peak_memory_in_bytes
    assert close(drop, LAYER_INPUTS), (drop, LAYER_INPUTS)
    assert full.temp_size_in_bytes - offload.temp_size_in_bytes >= 0.9 * LAYER_INPUTS
    # minimal keeps every matmul output besides: far more device memory than full.
    assert minimal.peak_memory_in_bytes > full.peak_memory_in_bytes + LAYER_INPUTS


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_mixed_layer_kinds_offload_every_layer_input_and_cost_no_more():
    """Sliding and global layers: every layer's input still reaches host memory, and the
    device peak stays that of the all-global model (a scan over 6-layer repeats of the
    pattern offloaded 2 layer inputs in 12 and held far more)."""
    offload, _ = compiled("offload")
    mixed, hlo = compiled("mixed_offload")
    assert close(mixed.host_temp_size_in_bytes, LAYER_INPUTS), mixed.host_temp_size_in_bytes
    assert stacked_layer_input_spaces(hlo) == {"S(5)"}
    assert mixed.peak_memory_in_bytes <= 1.05 * offload.peak_memory_in_bytes, (
        mixed.peak_memory_in_bytes, offload.peak_memory_in_bytes)


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_a_checkpoint_every_two_layers_offloads_half_the_layer_inputs():
    """remat.layers_per_checkpoint=2: the scan saves every other layer's input (host: half
    of them), and the device pays only the recomputed group's transient inputs (a few
    percent of its peak; without offload full remat's peak falls)."""
    offload, _ = compiled("offload")
    every_2, hlo = compiled("offload_every_2")
    assert close(every_2.host_temp_size_in_bytes, LAYER_INPUTS // 2, 0.02), \
        every_2.host_temp_size_in_bytes
    assert every_2.peak_memory_in_bytes <= 1.05 * offload.peak_memory_in_bytes


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_recast_weights_drops_the_compute_dtype_copy_of_the_layer_stacks():
    """Without remat.recast_weights XLA's TPU compiler casts each whole float32 layer stack
    to bf16 before the layer loops and holds the copies through the step; with it, no
    stack is cast whole and the peak falls by most of those copies."""
    full, full_hlo = compiled("full")
    recast, recast_hlo = compiled("recast")
    whole_stack_cast = rf"= bf16\[{LAYERS},[\d,]+\][^\n]*\bconvert\("
    assert len(re.findall(whole_stack_cast, full_hlo)) >= 5
    assert re.findall(whole_stack_cast, recast_hlo) == []
    layer_weights_bf16 = 2 * sum(math.prod(t.shape) * t.layers for t in parameter_tensors(
        load_recipe("tiny", AOT_SETS).model) if t.per_layer)
    drop = full.peak_memory_in_bytes - recast.peak_memory_in_bytes
    assert drop >= 0.75 * layer_weights_bf16, (drop, layer_weights_bf16)


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_offloading_the_optimizer_state_moves_the_moments_to_host_memory():
    """Only the step's arguments are asserted: XLA copies the moments to HBM at the top of
    the step, so its peak does not fall (here it rises by the moments' size)."""
    full, _ = compiled("full")
    offload, hlo = compiled("opt_offload")
    recipe = load_recipe("tiny", AOT_SETS)
    # Data parallel: every chip holds all parameters, so both f32 AdamW moments in full.
    moments = 2 * count_parameters(recipe.model) * 4                # 101,058,560 bytes
    assert full.host_argument_size_in_bytes == 0
    assert close(offload.host_argument_size_in_bytes, moments), offload.host_argument_size_in_bytes
    drop = full.argument_size_in_bytes - offload.argument_size_in_bytes
    assert close(drop, moments), (drop, moments)
    assert "S(5)" in hlo


# ------------------------------------------------------------------- CPU ----

CPU_SETS = ["train.steps=5", "train.warmup_steps=1", "runtime.log_every=1", "data.seq_len=64",
            "model.dtype=bfloat16", "checkpoint.every=2", "checkpoint.keep=5"]


def losses(records: list[dict]) -> list[float]:
    return [record["loss"] for record in records]


uses_full_losses = one_worker("test_remat_full_losses")  # trained once, not per worker


@pytest.fixture(scope="module")
def full_losses(tmp_path_factory):
    recipe = load_recipe("tiny", CPU_SETS)
    return losses(train(recipe, tmp_path_factory.mktemp("full"), Console(quiet=True)))


@uses_full_losses
def test_offloaded_layer_inputs_train_like_full_remat(tmp_path, full_losses):
    recipe = load_recipe("tiny", CPU_SETS + CASES["offload"])
    assert losses(train(recipe, tmp_path, Console(quiet=True))) == full_losses


@uses_full_losses
def test_a_checkpoint_every_two_layers_trains_like_every_layer(tmp_path, full_losses):
    """Sparser checkpoints only move work: the losses are those of full remat, exactly."""
    recipe = load_recipe("tiny", CPU_SETS + CASES["offload_every_2"])
    assert losses(train(recipe, tmp_path, Console(quiet=True))) == full_losses


@uses_full_losses
def test_a_layer_input_offloaded_in_slices_trains_like_one_piece(tmp_path, full_losses,
                                                                 monkeypatch):
    """Where one offloaded piece would reach libtpu's 4 GiB the layer input goes to the
    host in slices of d_model (trainer/model/remat.layer_input_pieces): forced to 4
    slices here, the losses are full remat's, exactly."""
    from lctrain.trainer.state import step
    monkeypatch.setattr(step, "layer_input_pieces", lambda recipe, rows, tokens: 4)
    recipe = load_recipe("tiny", CPU_SETS + CASES["offload"])
    assert losses(train(recipe, tmp_path, Console(quiet=True))) == full_losses


def saved_layer_inputs(sets: list[str]) -> int:
    """How many times per step the forward names a layer input (decoder_layer_input, what
    the scan saves or offloads), from the loss's jaxpr: each named slice counts."""
    from lctrain.kernels.jaxpr_walk import equations
    from lctrain.parallel import make_strategy
    from lctrain.trainer.state.step import make_loss_sums

    recipe = load_recipe("tiny", ["model.layers=6", "data.seq_len=64", *CASES["offload"],
                                  *sets])
    mesh = mesh_for(recipe, jax.devices()[:1])
    trainable = build_trainable(recipe, mesh)
    loss_sums = make_loss_sums(recipe, trainable.graphdef, make_strategy(recipe, mesh))
    batch = {name: jax.ShapeDtypeStruct((8, 64), jax.numpy.float32 if name == "loss_mask"
                                        else jax.numpy.int32)
             for name in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    jaxpr = jax.make_jaxpr(lambda p, b: loss_sums(p, b)[0])(trainable.abstract_state.params,
                                                            batch).jaxpr
    return sum(times for eqn, times in equations(jaxpr)
               if eqn.primitive.name == "name" and eqn.params["name"] == "decoder_layer_input")


def test_the_options_change_what_the_scan_names_for_saving(monkeypatch):
    """6 layers: each input named once; in groups of 2, the 3 groups' inputs; in groups of
    4, one group's and the 2 layers after it; in 4 slices of d_model, 4 names an input.
    (The training tests compare losses, which an ignored option would keep too.)"""
    from lctrain.trainer.state import step
    assert saved_layer_inputs([]) == 6
    assert saved_layer_inputs(["remat.layers_per_checkpoint=2"]) == 3
    assert saved_layer_inputs(["remat.layers_per_checkpoint=4"]) == 1 + 2  # a group, 2 alone
    monkeypatch.setattr(step, "layer_input_pieces", lambda recipe, rows, tokens: 4)
    assert saved_layer_inputs([]) == 6 * 4


def test_sparser_checkpoints_keep_a_rings_loss_and_gradients():
    """The equivalence suite's comparison (tests/test_strategies.py) for the option: 5
    layers in groups of 2 (the last alone) and in one group of 5, ring on data 2 x
    context 4, each against one device saving every layer input (computed once)."""
    import numpy as np

    from test_strategies import loss_and_grads, recipe_for
    layers = ["model.layers=5"]
    want_loss, want = loss_and_grads(recipe_for("none", {"data": 1}, 2, extra=layers),
                                     jax.devices()[:1])
    for every in (2, 5):
        loss, grads = loss_and_grads(recipe_for("ring", {"data": 2, "context": 4}, 2, extra=[
            *layers, f"remat.layers_per_checkpoint={every}"]), jax.devices()[:8])
        assert loss == pytest.approx(want_loss, rel=1e-6), every
        for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
            np.testing.assert_allclose(got, ref, atol=1e-5 * np.max(np.abs(ref)), rtol=0,
                                       err_msg=f"layers_per_checkpoint={every}")


@pytest.mark.parametrize("sets, words", [
    (["remat.layers_per_checkpoint=0"], "use 1 to model.layers"),
    (["remat.layers_per_checkpoint=3", "model.layers=2"], r"use 1 to model.layers \(2\)"),
    (["remat.layers_per_checkpoint=2", "remat.policy=save_all"], "save_all never does"),
    (["remat.layers_per_checkpoint=2", "model.layer_pattern=[{kind: sliding, count: 2, "
      "window: 8}, {kind: global}]"], "global layers only")])
def test_sparser_checkpoints_are_refused_where_they_do_not_apply(sets, words):
    with pytest.raises(RecipeError, match=f"remat.layers_per_checkpoint.*{words}"):
        load_recipe("tiny", sets)


@pytest.mark.parametrize("percent", [0, 120])
def test_a_compiler_remat_percent_outside_the_hbm_is_refused(percent):
    with pytest.raises(RecipeError, match=rf"remat.compiler_remat_percent.*{percent}.*1 to 100"):
        load_recipe("tiny", [f"remat.compiler_remat_percent={percent}"])


@uses_full_losses
def test_offloaded_optimizer_state_trains_and_resumes_like_on_device(tmp_path, full_losses):
    recipe = load_recipe("tiny", CPU_SETS + ["optimizer.offload=true"])
    assert losses(train(recipe, tmp_path, Console(quiet=True))) == full_losses
    # Resume from the step-2 checkpoint (drop the later ones): the moments come back into
    # host memory and steps 3-5 repeat exactly.
    for step in (4, 5):
        shutil.rmtree(tmp_path / "checkpoints" / str(step))
    resumed = train(recipe, tmp_path, Console(quiet=True))
    assert losses(resumed) == full_losses[2:]


def test_offloaded_moments_live_in_pinned_host_memory():
    recipe = load_recipe("tiny", ["optimizer.offload=true"])
    trainable = build_trainable(recipe, mesh_for(recipe))
    state = trainable.init()
    kinds = {(leaf.ndim > 0, leaf.sharding.memory_kind)
             for leaf in jax.tree.leaves(state.opt_state)}
    assert kinds == {(True, "pinned_host"), (False, "device")}  # moments / step counters
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {"device"}


def test_the_tpu_compiler_options_reach_the_tpu_compiler_alone_and_say_so_elsewhere():
    recipe = load_recipe("tiny", [*CASES["recast"], "remat.compiler_remat_percent=85"])
    assert compiler_options(recipe, "tpu") == {
        "xla_jf_bf16_propagation": "false",
        "xla_jf_rematerialization_percent_shared_memory_limit": "85"}
    assert compiler_options(recipe, "cpu") == compiler_options(load_recipe("tiny"), "tpu") == {}
    console = Console(record=True, width=200)
    check_devices(recipe, jax.devices()[:1], console)
    said = console.export_text()
    assert "note: remat.recast_weights changes nothing on cpu" in said
    assert "note: remat.compiler_remat_percent changes nothing on cpu" in said


def test_offload_needs_pinned_host_memory():
    recipe = load_recipe("tiny", ["optimizer.offload=true"])
    check_host_memory(recipe, {"device", "pinned_host"})
    with pytest.raises(RecipeError, match="optimizer.offload"):
        check_host_memory(recipe, {"device"})
    recipe = load_recipe("tiny", CASES["offload"])
    with pytest.raises(RecipeError, match="remat.tensors.decoder_layer_input"):
        check_host_memory(recipe, {"device"})
    assert "pinned_host" in {memory.kind for memory in jax.devices()[0].addressable_memories()}


# --------------------------------- the MLP's weight gradients before attention's ----

RING_SETS = ["runtime.cpu_devices=0", "model.preset=tiny", "model.layers=4",
             "model.d_model=512", "model.d_ff=1792", "model.n_heads=4", "model.n_kv_heads=1",
             "model.dtype=bfloat16", "data.seq_len=65536", "data.batch_size=1", "mesh.data=1",
             "mesh.context=4", "parallel.strategy=ring", "attention.impl=pallas"]
MLP_INTERMEDIATE = 65536 // DEVICES * 1792 * 2                    # [tokens, d_ff] bf16: 56 MiB


def ring_peak(monkeypatch, fenced: bool) -> int:
    from lctrain.parallel import aot
    from lctrain.trainer.state import build
    from lctrain.trainer.model import transformer as model
    if not fenced:
        monkeypatch.setattr(model, "gradients_together", lambda *arrays: arrays)
    recipe = load_recipe("tiny", RING_SETS)
    return build.compile_train_step(recipe, aot.topology_devices(TOPOLOGY)
                                  ).memory_analysis().peak_memory_in_bytes


@pytest.mark.slow
@needs_libtpu
def test_mlp_weight_gradients_are_done_before_the_ring_backward(monkeypatch):
    """Without trainer/model/transformer.gradients_together XLA schedules the MLP's weight-gradient
    matmuls after the layer's ring backward (nothing else in the layer needs them) and
    holds the MLP's [tokens, d_ff] intermediates through it (1.9 of them more at the
    peak here, 474 against 581 MiB; llama3.1-8b at 256K tokens, 8.99 GB per chip). The
    Pallas kernel, as on a TPU: with the xla kernel, which holds a fresh f32 dK/dV pair
    beside the arrived one at the ring's last step, the margin is 1.2."""
    fenced = ring_peak(monkeypatch, fenced=True)
    unfenced = ring_peak(monkeypatch, fenced=False)
    assert unfenced - fenced >= 1.5 * MLP_INTERMEDIATE, (fenced, unfenced)


def test_the_layers_of_a_checkpointed_group_are_recomputed_apart():
    """remat.layers_per_checkpoint: the group's layers are unrolled inside the group's
    checkpoint, so each layer's own checkpoint prevents CSE: the backward recomputes the
    group's forward to reach a layer's input, and XLA would otherwise merge that with the
    layer's own recomputation and keep its intermediates through the next layer's
    backward (benchmarks/RESULTS.md, "One layer input in two, recomputed apart").
    The group's checkpoint, a scan step, leaves CSE to the scan."""
    import jax.numpy as jnp

    from lctrain.kernels.jaxpr_walk import subprograms
    from lctrain.trainer.model.layer_scan import scan_layer_groups

    def remat(fn, prevent_cse=False):
        return jax.checkpoint(fn, prevent_cse=prevent_cse)

    def checkpoints(jaxpr, depth=0):
        for eqn in jaxpr.eqns:
            is_checkpoint = "prevent_cse" in eqn.params  # jax.checkpoint's (remat2)
            inside = depth + is_checkpoint
            if is_checkpoint:
                yield inside, eqn.params["prevent_cse"]
            for program in subprograms(eqn):
                yield from checkpoints(program, inside)

    stacked = {"w": jnp.ones((4, 8))}
    jaxpr = jax.make_jaxpr(lambda x: scan_layer_groups(
        x, stacked, lambda x, layer: jnp.tanh(x * layer["w"]), remat, 2))(jnp.ones(8))
    assert sorted(checkpoints(jaxpr.jaxpr)) == [(1, False), (2, True), (2, True)]
