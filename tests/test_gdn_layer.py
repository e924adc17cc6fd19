"""Linear layers (model.layer_pattern kind linear): Qwen3-Next's Gated DeltaNet
(trainer/model/gdn_layer.py) against transformers' Qwen3NextGatedDeltaNet with the same weights
(PyTorch, CPU, f32), packed documents against each document alone, a [linear x3, global]
model's loss and gradients under context parallelism (linear layers on state_passing,
global ones on ring) against the single device, and the recipe errors."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from lctrain.parallel import make_strategy, planner
from lctrain.parallel.auto import choose_strategy
from lctrain.parallel.chips import CHIPS
from lctrain.parallel.cost_model import F32
from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.model.gdn_layer import GatedDeltaNet
from lctrain.trainer.model.rope import kind_config, rotary_tables
from lctrain.trainer.model.transformer import Transformer
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import make_forward

from helpers import fast_jit, one_worker
from test_strategies import loss_and_grads, mixed_batch, recipe_for

E, HK, HV, DK, DV, KERNEL, SEQ = 32, 2, 4, 8, 8, 4, 24
LINEAR_KEYS = [f"model.d_model={E}", f"model.linear_key_heads={HK}",
               f"model.linear_value_heads={HV}", f"model.linear_key_head_dim={DK}",
               f"model.linear_value_head_dim={DV}", f"model.linear_conv_kernel={KERNEL}",
               "model.linear_chunk=4", "model.norm_eps=1e-6"]
LINEAR_PATTERN = "model.layer_pattern=[{kind: linear, count: 3}, {kind: global}]"


def torch_layer():
    config = Qwen3NextConfig(hidden_size=E, linear_num_key_heads=HK, linear_num_value_heads=HV,
                             linear_key_head_dim=DK, linear_value_head_dim=DV,
                             linear_conv_kernel_dim=KERNEL, rms_norm_eps=1e-6,
                             num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).float()
    with torch.no_grad():
        for p in layer.parameters():   # every weight random, norm and decays included
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.3))
    return layer


def copy_weights(ours, theirs):
    """transformers' fused, per-key-head interleaved projections into ours (per head)."""
    t = {name: p.detach().numpy() for name, p in theirs.named_parameters()}
    r = HV // HK
    qkvz = t["in_proj_qkvz.weight"].T.reshape(E, HK, 2 * DK + 2 * r * DV)
    q, k, v, z = np.split(qkvz, np.cumsum([DK, DK, r * DV]), axis=-1)
    ba = t["in_proj_ba.weight"].T.reshape(E, HK, 2 * r)
    conv = t["conv1d.weight"][:, 0].T
    conv_q, conv_k, conv_v = np.split(conv, [HK * DK, 2 * HK * DK], axis=-1)
    values = dict(wq=q, wk=k, wv=v.reshape(E, HV, DV), wz=z.reshape(E, HV, DV),
                  wb=ba[..., :r].reshape(E, HV), wa=ba[..., r:].reshape(E, HV),
                  conv_q=conv_q.reshape(KERNEL, HK, DK), conv_k=conv_k.reshape(KERNEL, HK, DK),
                  conv_v=conv_v.reshape(KERNEL, HV, DV), dt_bias=t["dt_bias"],
                  a_log=t["A_log"], norm_scale=t["norm.weight"],
                  wo=t["out_proj.weight"].T.reshape(HV, DV, E))
    for name, value in values.items():
        getattr(ours, name)[...] = jax.numpy.asarray(value)


def one_device_mix():
    recipe = load_recipe("tiny", [*LINEAR_KEYS, "model.layers=1", f"data.seq_len={SEQ}",
                                "data.batch_size=2", "mesh.data=1",
                                "model.layer_pattern=[{kind: linear}]"])
    return recipe.model, make_strategy(recipe, mesh_for(recipe, jax.devices()[:1])).attends[
        "linear"]


def ours_on(x, positions, segment_ids, theirs):
    cfg, mix = one_device_mix()
    layer = GatedDeltaNet(cfg, nnx.Rngs(0))
    copy_weights(layer, theirs)
    return np.asarray(jax.jit(lambda x, p, s: layer(x, p, s, None, mix))(
        x, positions, segment_ids))


def test_layer_matches_transformers_and_packed_documents_each_document_alone():
    """One call of our layer on two rows. Row 1, one document: transformers' output on
    it. Row 0 packs documents of 10, 3 (shorter than the conv) and 11 tokens: each part of
    the output equals transformers' on that document alone (neither the conv nor the
    state crosses a boundary)."""
    theirs = torch_layer()
    x = np.random.default_rng(1).standard_normal((2, SEQ, E), dtype=np.float32)
    bounds = [0, 10, 13, SEQ]
    segment_ids = np.ones((2, SEQ), np.int32)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (2, SEQ)).copy()
    for doc, (start, end) in enumerate(zip(bounds, bounds[1:])):
        segment_ids[0, start:end] = doc + 1
        positions[0, start:end] = np.arange(end - start)
    ours = ours_on(x, positions, segment_ids, theirs)
    whole = theirs(torch.from_numpy(x[1:])).detach().numpy()
    assert np.abs(whole).max() > 0.1
    np.testing.assert_allclose(ours[1:], whole, atol=1e-4, rtol=1e-4)
    for start, end in zip(bounds, bounds[1:]):
        alone = theirs(torch.from_numpy(x[:1, start:end])).detach().numpy()
        np.testing.assert_allclose(ours[0, start:end], alone[0], atol=1e-4, rtol=1e-4)


LINEAR_MODEL = [*LINEAR_KEYS, "model.layers=4", LINEAR_PATTERN]
PER_KIND = "{global: ring, linear: state_passing}"


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(recipe_for("none", {"data": 1}, 2, extra=LINEAR_MODEL),
                          jax.devices()[:1])


# Three delta-rule layers in f32 (the fold of the runs' states sums in another order than
# one device's chunk scan) leave each gradient within about 1e-4 of its largest element
# (measured: 9e-5 at most); one wrong conv halo puts them off by O(1) (measured: 0.4-2).
GRAD_TOL = 5e-4


@one_worker("test_gdn_layer_reference")  # the reference computed once, not per worker
@pytest.mark.parametrize("load_balance", [True, False], ids=["balanced", "natural"])
def test_train_step_matches_single_device(reference, load_balance):
    """Context 4 (data 2), packed rows: runs of 8 tokens (balanced) or 16, so documents
    and the conv's taps cross runs and devices."""
    recipe = recipe_for(PER_KIND, {"data": 2, "context": 4}, 2, load_balance,
                        extra=LINEAR_MODEL)
    loss, grads = loss_and_grads(recipe, jax.devices())
    reference_loss, reference_grads = reference
    assert loss == pytest.approx(reference_loss, rel=1e-5)
    for (path, ours), expected in zip(jax.tree_util.tree_leaves_with_path(grads),
                                      jax.tree.leaves(reference_grads)):
        np.testing.assert_allclose(ours, expected, rtol=0,
                                   atol=GRAD_TOL * np.abs(expected).max(),
                                   err_msg=jax.tree_util.keystr(path))


# Five layers: the pattern once, then its first layer (a repeat cut short).
MIXED_KINDS = ["linear", "linear", "linear", "global", "linear"]


def per_layer_hidden(model, attends, batch):
    """The final hidden states with the layers applied one by one in a Python loop, each
    taken from its kind's stack by counting, as written out in MIXED_KINDS."""
    stacks = {"linear": nnx.split(model.linear_layers), "global": nnx.split(model.layers)}
    taken = {"linear": 0, "global": 0}
    x = model.embedding[...][batch["inputs"]]
    for kind in MIXED_KINDS:
        graphdef, stacked = stacks[kind]
        layer = nnx.merge(graphdef, jax.tree.map(lambda p: p[taken[kind]], stacked))
        taken[kind] += 1
        rotary = (None if kind == "linear" else
                  rotary_tables(batch["positions"], kind_config(model.cfg, kind)))
        x = layer(x, batch["positions"], batch["segment_ids"], rotary, attends[kind])
    return model.final_norm(x)


def test_mixed_layers_match_a_per_layer_loop():
    """The scan (one step per layer, each reading its layer from its kind's stack) against
    the loop: the same hidden states, and the same gradients for both stacks."""
    recipe = recipe_for("none", {"data": 1}, 2, extra=[
        *LINEAR_KEYS, "model.layers=5", LINEAR_PATTERN, "remat.policy=full"])
    assert recipe.model.layer_kinds() == MIXED_KINDS
    strategy = make_strategy(recipe, mesh_for(recipe, jax.devices()[:1]))
    graphdef, params = nnx.split(Transformer(recipe.model, nnx.Rngs(3)))
    forward = make_forward(recipe, graphdef, strategy)
    fixed = mixed_batch(recipe.model.vocab, recipe.data.seq_len)
    batch = {name: getattr(fixed, name) for name in ("inputs", "positions", "segment_ids")}
    probe = np.random.default_rng(0).standard_normal((*fixed.inputs.shape, E))

    def weighted(hidden):
        return (hidden.astype(np.float32) * probe).sum()

    def looped(params):
        return weighted(per_layer_hidden(nnx.merge(graphdef, params), strategy.attends, batch))

    def scanned(params):
        return weighted(forward(params, batch)[1])

    scanned_value, scanned_grads = fast_jit(jax.value_and_grad(scanned), params)(params)
    looped_value, looped_grads = fast_jit(jax.value_and_grad(looped), params)(params)
    # This random model is chaotic: params scaled by 1 + 1e-6 move its gradients by 4% of
    # their largest element, the same loop eager rather than jitted by 0.2%, the scan by
    # 0.06% (measured). Two linear layers swapped move every gradient by 93% or more.
    assert float(scanned_value) == pytest.approx(float(looped_value), rel=1e-4)
    for (path, ours), expected in zip(jax.tree_util.tree_leaves_with_path(scanned_grads),
                                      jax.tree.leaves(looped_grads)):
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-2 * np.abs(expected).max(),
                                   err_msg=jax.tree_util.keystr(path))


CONTEXT = ["mesh.context=4", "mesh.data=2", "model.layers=4"]


@pytest.mark.parametrize("overrides, key, words", [
    (["model.layer_pattern=[{kind: linear, count: 3, window: 8}, {kind: global}]",
      f"parallel.strategy={PER_KIND}"], "model.layer_pattern[0].window",
     "only sliding groups take a window"),
    ([LINEAR_PATTERN, "parallel.strategy={global: state_passing, linear: state_passing}"],
     "parallel.strategy.global", "state_passing runs linear layers only"),
    ([LINEAR_PATTERN, "parallel.strategy={global: ring, linear: ring}"],
     "parallel.strategy.linear", "run on state_passing"),
    ([LINEAR_PATTERN, "parallel.strategy=ring"], "parallel.strategy", "run on state_passing"),
    ([LINEAR_PATTERN, f"parallel.strategy={PER_KIND}", "model.linear_value_heads=3"],
     "model.linear_value_heads", "multiple of model.linear_key_heads"),
    ([LINEAR_PATTERN, f"parallel.strategy={PER_KIND}", "model.linear_conv_kernel=0"],
     "model.linear_conv_kernel", "must be positive")])
def test_bad_linear_keys_name_the_key(overrides, key, words):
    with pytest.raises(RecipeError, match=f"recipe key '{key.replace('[', '.').replace(']', '.')}'"
                                          f" = .*{words}") as err:
        load_recipe("tiny", [*CONTEXT, *overrides])
    assert "\n" not in str(err.value)


def test_export_refuses_linear_layers_in_one_line():
    from lctrain.recipes.hf_config import check_exportable

    recipe = load_recipe("tiny", [*CONTEXT, LINEAR_PATTERN, f"parallel.strategy={PER_KIND}"])
    with pytest.raises(RecipeError, match="recipe key 'model.layer_pattern' = "
                                          r"\['linear', 'global'\]: .*no linear") as err:
        check_exportable(recipe.model)
    assert "\n" not in str(err.value)


def test_plan_puts_linear_layers_on_state_passing():
    """The built-in recipe (36 linear layers of 32 value heads of 128, context 4, one row
    per device, remat full): the linear kind's traffic is state_passing's all-gathers,
    by hand: per layer and run of the 3 other devices' 2 runs, [A | B] f32 (128 x 256 per
    head) in both forward passes and the start states' gradients (128 x 128) once; and the
    conv's sends: before each of the 2 runs 3 tokens of q, k (16 heads) and v (32 heads)
    of 128 in bf16, per layer in both forward passes and their gradients back, and the 3
    tokens' two int32 ids in both forward passes of every layer (a switch picks each
    layer's kind, and XLA hoists nothing out of it)."""
    recipe = load_recipe("qwen3_next_like")
    sizes = {"data": 4, "fsdp": 1, "context": 4, "tensor": 1}
    result = planner.plan(recipe, CHIPS["v5p"], sizes)
    assert result.plans and all(p.kinds["linear"].strategy == "state_passing"
                                for p in result.plans)
    per_run_head = 128 * F32
    state_maps = 36 * 3 * 2 * 32 * per_run_head * (2 * 256 + 128)
    conv = 2 * 3 * (36 * 3 * (2 * 16 + 32) * 128 * 2 + 36 * 2 * 2 * 4)
    assert result.plans[0].kinds["linear"].comm_bytes == state_maps + conv
    assert result.plans[0].kinds["linear"].layers == 36
    # No sequence length in it.
    longer = planner.plan(load_recipe("qwen3_next_like", ["data.seq_len=524288"]),
                          CHIPS["v5p"], sizes)
    assert longer.plans[0].kinds["linear"].comm_bytes == state_maps + conv
    chosen, _, _ = choose_strategy(load_recipe("qwen3_next_like", ["parallel.strategy=auto"]),
                                   sizes, 95 * 2**30)
    assert chosen["linear"] == "state_passing" and chosen["global"] != "state_passing"


def test_conv_wider_than_a_stored_chunk_stops_before_compiling():
    """64 tokens over context 4, load-balanced: chunks of 8, so a conv of 10 taps (9
    before each token) is refused when the mesh is built."""
    recipe = recipe_for(PER_KIND, {"data": 2, "context": 4}, 2,
                        extra=[*LINEAR_MODEL, "model.linear_conv_kernel=10"])
    with pytest.raises(RecipeError, match=r"'model.linear_conv_kernel' = 10: .*kernel - 1 "
                                          r"<= the 8 tokens"):
        mesh_for(recipe, jax.devices())
