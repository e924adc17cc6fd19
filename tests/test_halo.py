"""Sliding-window attention under context parallelism, at the level of
`ContextStrategy.attend`: the halo strategy (parallel/halo.py) and every other strategy
with a window give the dense single-device result (out and dq, dk, dv, f32), on the
suite's 8 CPU devices; and the halo's sends move window-1 tokens, not the chunk.

Inputs: 2 rows of 64 tokens, 4 query heads over 2 KV heads; row 0 packs three
documents. The strategy sees them in its stored (load-balanced) order.
"""

import jax
import numpy as np
import pytest

from lctrain.parallel import STRATEGIES
from lctrain.parallel.cost_model import Dims
from lctrain.parallel.halo import Halo, check_halo_window
from lctrain.parallel.hlo import collective_bytes
from lctrain.recipes import load_recipe
from lctrain.recipes.schema import RecipeError
from lctrain.trainer.state.build import mesh_for
from helpers import fast_jit
from reference import dense_attention

B, SEQ, HQ, HKV, D = 2, 64, 4, 2, 16
TOL = 2e-5


def strategy_for(name, context, load_balance, impl="xla", extra=(), seq=SEQ):
    sets = [f"parallel.strategy={name}", f"parallel.load_balance={load_balance}",
            f"data.seq_len={seq}", f"data.batch_size={B}", f"model.n_heads={HQ}",
            f"model.n_kv_heads={HKV}", f"model.d_model={HQ * D}", f"attention.impl={impl}",
            "attention.block_q=8", "attention.block_kv=8", "mesh.data=1",
            f"mesh.context={context}"]
    if name == "halo":  # a model of sliding layers (the window of each attend is the test's)
        sets.append("model.layer_pattern=[{kind: sliding, count: 1, window: 8}]")
    sets.extend(extra)
    recipe = load_recipe("tiny", sets)
    devices = jax.devices()[:context]
    mesh = mesh_for(recipe, devices)
    return STRATEGIES[name](recipe, mesh)


def inputs(seq=SEQ):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, seq, h, D), dtype=np.float32)
                     for h in (HQ, HKV, HKV, HQ))
    segment_ids = np.ones((B, seq), np.int32)
    segment_ids[0, seq // 3:] = 2
    segment_ids[0, 2 * seq // 3:] = 3
    return q, k, v, dout, segment_ids


def grads_of(attend, q, k, v, dout, segment_ids):
    """(out, dq, dk, dv) of `attend(q, k, v, segment_ids)` under cotangent dout."""
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids), q, k, v)
    return (out, *vjp(dout))


def strategy_vs_dense(strategy, window):
    """[(ours, dense)] for out, dq, dk, dv; ours computed in the stored order and put
    back in sequence order."""
    q, k, v, dout, segment_ids = inputs()
    order = strategy.sequence_order(SEQ)
    order = np.arange(SEQ) if order is None else order
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (B, SEQ))

    def attend(q, k, v, segment_ids):
        return strategy.attend(q, k, v, positions, segment_ids, window=window)

    args = [x[:, order] for x in (q, k, v, dout, segment_ids)]
    stored = fast_jit(lambda *xs: grads_of(attend, *xs), *args)(*args)
    ours = [np.asarray(x)[:, np.argsort(order)] for x in stored]

    def dense(q, k, v, segment_ids):
        return dense_attention(q, k, v, positions, positions, segment_ids, segment_ids,
                               window=window)[0]

    want = grads_of(dense, q, k, v, dout, segment_ids)
    return list(zip(ours, (np.asarray(x) for x in want)))


def assert_matches_dense(strategy, window):
    for name, (got, want) in zip(("out", "dq", "dk", "dv"),
                                 strategy_vs_dense(strategy, window)):
        np.testing.assert_allclose(got, want, atol=TOL, err_msg=name)


# (context, load balance, kernel, window): chunks of 8 (context 4, balanced) or 16 tokens;
# windows with w-1 below a chunk and equal to it. Last: the sequence split over the
# context x ulysses axes of a usp mesh (global layers on usp, sliding ones on halo).
ON_USP_MESH = ["parallel.ulysses=2", "model.layers=2",
               "parallel.strategy={global: usp, sliding: halo}",
               "model.layer_pattern=[{kind: sliding, count: 1, window: 8}, {kind: global}]"]
HALO_CASES = [(4, True, "xla", 5, []), (4, True, "xla", 9, []), (4, False, "xla", 17, []),
              (2, True, "xla", 17, []), (2, False, "pallas", 9, []),
              (4, True, "pallas", 9, []), (4, True, "xla", 5, ON_USP_MESH)]


@pytest.mark.parametrize("context, load_balance, impl, window, extra", HALO_CASES)
def test_halo_matches_dense(context, load_balance, impl, window, extra):
    assert_matches_dense(strategy_for("halo", context, load_balance, impl, extra), window)


# Every other strategy with a window of 12 (crossing chunks): xla on context 4 (usp:
# 2 x 2), and ring's Pallas path; ring in natural order also skips steps wholly behind
# every query's window.
OTHER_CASES = [("none", 1, False, "xla", []), ("all_gather", 4, True, "xla", []),
               ("ulysses", 4, True, "xla", []), ("ring", 4, True, "xla", []),
               ("ring", 4, False, "xla", []), ("ring", 4, True, "pallas", []),
               ("usp", 4, True, "xla", ["parallel.ulysses=2"])]


@pytest.mark.parametrize("name, context, load_balance, impl, extra", OTHER_CASES)
def test_strategy_with_window_matches_dense(name, context, load_balance, impl, extra):
    assert_matches_dense(strategy_for(name, context, load_balance, impl, extra), 12)


def test_halo_refuses_global_layers_and_wide_windows():
    strategy = strategy_for("halo", 4, True)
    q, k, v, _, segment_ids = inputs()
    positions = np.zeros((B, SEQ), np.int32)
    with pytest.raises(ValueError, match="sliding-window layers only"):
        strategy.attend(q, k, v, positions, segment_ids)
    with pytest.raises(ValueError, match="window - 1 <= the 8 tokens"):
        jax.eval_shape(lambda q: strategy.attend(q, k, v, positions, segment_ids,
                                                 window=10), q)
    check_halo_window(9, 8)


def test_recipe_window_wider_than_a_chunk_stops_before_compiling():
    """Context 4, load-balanced, 64 tokens: chunks of 8, so window 10 is refused when the
    mesh is built, naming the key and the fix."""
    with pytest.raises(RecipeError, match=r"'model.layer_pattern\[0\].window' = 10: .*"
                                          r"window - 1 <= the 8 tokens.*or strategy ring"):
        strategy_for("halo", 4, True, extra=[
            "model.layer_pattern=[{kind: sliding, count: 1, window: 10}]"])


def halo_permute_bytes(seq, window):
    """collective-permute bytes one device receives in the compiled (CPU) forward and
    backward of the halo's attend, context 4, load-balanced."""
    strategy = strategy_for("halo", 4, True, seq=seq)
    q, k, v, dout, segment_ids = inputs(seq)
    positions = np.zeros((B, seq), np.int32)

    def attend(q, k, v, segment_ids):
        return strategy.attend(q, k, v, positions, segment_ids, window=window)

    hlo = jax.jit(lambda *xs: grads_of(attend, *xs)).lower(
        q, k, v, dout, segment_ids).compile().as_text()
    return collective_bytes(hlo).bytes_by_kind["collective-permute"]


def test_halo_sends_window_minus_one_tokens():
    """Two exchanges (load-balanced) of window-1 = 4 tokens each way: forward K, V (f32)
    and the int32 positions and segment ids, backward the halo's dK, dV; the same at
    64 and 128 tokens (chunks of 8 and 16): independent of the sequence length. The
    cost model (Halo.traffic, one forward pass as under remat.policy=save_all) agrees."""
    width, kv_bytes = 4, HKV * D * 4
    forward = 2 * B * width * (2 * kv_bytes + 2 * 4)
    backward = 2 * B * width * 2 * kv_bytes
    assert halo_permute_bytes(64, width + 1) == forward + backward
    assert halo_permute_bytes(128, width + 1) == forward + backward
    dims = Dims(b=B, rows=B, accum=1, s=SEQ, c=4, u=1, r=1, t=1, z=4, g=4, p=4, e=HQ * D,
                h=HQ, kv=HKV, d=D, f=4 * HQ * D, v=256, layers=1, remat="save_all",
                context_kept=True, window=width + 1)
    assert Halo.traffic(dims) == {"strategy_halo": ("collective-permute", forward + backward)}
