"""Multi-slice meshes (mesh.dcn_data, mesh.dcn_fsdp): the hybrid mesh's placement, the
load-time checks, the planner's DCN traffic by hand (fast), and what a compiled two-slice
train step sends across slices (slow, needs libtpu)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from helpers import TINY_MODEL, tiny_recipe
from lctrain.cli.main import app
from lctrain.parallel import planner
from lctrain.parallel.chips import CHIPS
from lctrain.parallel.mesh import MESH_AXES, build_mesh
from lctrain.parallel.planner.traffic import dcn_bytes
from lctrain.recipes import RecipeError, check_against_devices, load_recipe
from tpu_aot import needs_libtpu

V5P = CHIPS["v5p"]
# helpers.TINY_MODEL, two sequences of 4096 tokens on a ring.
TINY = (*TINY_MODEL, "data.batch_size=2", "parallel.strategy=ring")
L, E = 2, 128
MATRICES = 2 * 16384 + 2 * 4096 + 3 * 49152        # one layer's weight matrices


tiny = functools.partial(tiny_recipe, TINY)


def slice_of_each_position(mesh, slice_of) -> np.ndarray:
    return np.vectorize(slice_of, otypes=[int])(mesh.devices)


# -------------------------------------------------------------- placement ----

@pytest.mark.parametrize("sizes, dcn", [
    ({"data": 2, "fsdp": 1, "context": 4, "tensor": 1}, {"data": 2}),
    ({"data": 2, "fsdp": 2, "context": 2, "tensor": 1}, {"data": 2, "fsdp": 2}),
    ({"data": 4, "fsdp": 1, "context": 2, "tensor": 1}, {"data": 2}),
])
def test_fake_slices_are_whole_blocks_of_the_dcn_axes(sizes, dcn):
    """CPU devices carry no slice_index: slices are equal groups of consecutive ids, and
    each one is exactly the positions with one index of the slice part (index // in-slice
    size) of data and fsdp: slice = dcn_data index x dcn_fsdp + dcn_fsdp index. Handed
    over shuffled, so that laying them out in the order given would scatter the slices."""
    devices = [jax.devices()[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)]
    mesh = build_mesh(sizes, devices=devices, dcn=dcn)
    per_slice = 8 // (dcn.get("data", 1) * dcn.get("fsdp", 1))
    slices = slice_of_each_position(mesh, lambda d: d.id // per_slice)
    shape = dict(zip(MESH_AXES, mesh.devices.shape))
    data_part = np.arange(shape["data"]) // (shape["data"] // dcn.get("data", 1))
    fsdp_part = np.arange(shape["fsdp"]) // (shape["fsdp"] // dcn.get("fsdp", 1))
    expected = data_part[:, None] * dcn.get("fsdp", 1) + fsdp_part[None, :]
    assert (slices == expected[:, :, None, None, None]).all()
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@needs_libtpu
def test_real_slices_follow_slice_index_whatever_the_device_order():
    """Two v5p:2x2x1 slices (libtpu's topology devices carry slice_index), handed over in
    reverse: slice 0 fills data index 0 and the context ring stays in one slice."""
    from lctrain.parallel.aot import topology_devices

    devices = topology_devices("v5p:2x2x1", slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    mesh = build_mesh({"data": 2, "fsdp": 1, "context": 4, "tensor": 1},
                      devices=devices[::-1], dcn={"data": 2})
    slices = slice_of_each_position(mesh, lambda d: d.slice_index)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()
    with pytest.raises(RecipeError, match="the devices form 2"):
        build_mesh({"data": 2, "fsdp": 2, "context": 2, "tensor": 1}, devices=devices,
                   dcn={"data": 2, "fsdp": 2})


# ------------------------------------------------------- load-time checks ----

def test_context_across_slices_is_refused_with_the_reason():
    """A mesh that names all its devices is checked at load; one with an axis to fill
    (-1) once the device count is known."""
    reason = r"'mesh.context' = 8: .*inside one slice \(4 devices\).*data-center network \(DCN\)"
    with pytest.raises(RecipeError, match=reason):
        tiny("mesh.data=1", "mesh.context=8", "mesh.dcn_data=2")
    with pytest.raises(RecipeError, match=reason):
        check_against_devices(tiny("mesh.data=-1", "mesh.context=8", "mesh.dcn_data=2"), 8)
    check_against_devices(tiny("mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                               "mesh.dcn_data=2"), 8)    # 2 x 2 = one slice of 4: fine
    with pytest.raises(RecipeError, match="'mesh.tensor' = 8: .*inside one slice"):
        tiny("mesh.data=1", "mesh.context=1", "mesh.tensor=8", "mesh.dcn_data=2",
             "model.n_kv_heads=8", "parallel.strategy=none")


@pytest.mark.parametrize("overrides, message", [
    (("mesh.data=4", "mesh.context=2", "mesh.dcn_data=3"),
     "'mesh.dcn_data' = 3: must divide mesh.data (4)"),
    (("mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "mesh.dcn_fsdp=4"),
     "'mesh.dcn_fsdp' = 4: must divide mesh.fsdp (2)"),
    (("mesh.dcn_data=0",), "'mesh.dcn_data' = 0: must be >= 1"),
])
def test_dcn_degrees_must_divide_their_axis_at_load(overrides, message):
    with pytest.raises(RecipeError) as err:
        tiny(*overrides)
    assert message in str(err.value)


def test_filled_axis_is_checked_once_resolved():
    recipe = tiny("mesh.data=-1", "mesh.context=4", "mesh.dcn_data=4")   # data fills to 2
    with pytest.raises(RecipeError, match="'mesh.context' = 4"):        # slices of 2
        check_against_devices(recipe, 8)


def test_slice_count_of_the_devices_must_match():
    recipe = tiny("mesh.data=2", "mesh.context=4", "mesh.dcn_data=2")
    assert check_against_devices(recipe, 8, slices=2)["data"] == 2
    with pytest.raises(RecipeError, match="form 1 slice.*= 2; make the product 1"):
        check_against_devices(recipe, 8, slices=1)


def test_plan_refuses_context_across_slices_in_one_line_exit_2():
    result = CliRunner().invoke(app, ["plan", "--topology", "v5p:2x2x1", "--slices", "2",
                                      *[f"--set={s}" for s in TINY], "--set", "mesh.data=1",
                                      "--set", "mesh.context=8", "--set", "mesh.dcn_data=2"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert "mesh.context" in result.output and "DCN" in result.output


# ------------------------------------------------------------ reading HLO ----

# What a slice's program holds where its collectives cross slices (shapes and attributes
# as XLA's TPU compiler writes them, trimmed): a gradient all-reduce over every in-slice
# position of slices 1 and 2 (XLA's shorthand), and a weight all-gather between devices
# named by id, inside a loop of 3 trips.
MEGASCALE_HLO = """\
HloModule jit_train_step, num_partitions=4

%cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %t = token[] after-all()
  %recv.2 = (f32[2,1,16]{2,1,0:T(1,128)}, u32[], token[]) recv(%t), channel_id=5, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_target={{100000,200000},{100001,200001}},_xla_megascale_transfer_type="ALL_GATHER"}
  ROOT %r = (s32[]) tuple(%p)
}

ENTRY %main (x: s32[]) -> s32[] {
  %x = s32[] parameter(0)
  %zero = s32[] constant(0)
  %t = token[] after-all()
  %recv.1 = (bf16[12,8,128]{2,1,0}, u32[], token[]) recv(%t), channel_id=25, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.94_0",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %send.1 = (bf16[12,8,128]{2,1,0}, u32[], token[]) send(%x, %t), channel_id=26, is_host_transfer=true, frontend_attributes={_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %init = (s32[]) tuple(%zero)
  %loop = (s32[]) while(%init), condition=%cond, body=%body
  ROOT %ar = s32[] all-reduce(%x), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%cond
}
"""


def test_cross_slice_transfers_are_read_from_their_recv():
    from lctrain.parallel import hlo

    ops, unknown = hlo.collective_ops(MEGASCALE_HLO)
    assert unknown == 0
    dcn = {op.kind: op for op in ops if op.dcn}
    # all-reduce over 2 slices of the result bf16[12,8,128]: 2 x 1/2 of 24576 bytes, once
    # (the send is not counted again)
    assert dcn["all-reduce"].groups == [[1, 2]] and dcn["all-reduce"].runs == 1
    assert dcn["all-reduce"].received_bytes == 24576
    # all-gather in pairs of f32[2,1,16] (128 bytes): half of it arrives, 3 times a step
    assert dcn["all-gather"].groups == [[100000, 200000], [100001, 200001]]
    assert (dcn["all-gather"].received_bytes, dcn["all-gather"].runs) == (64, 3)
    in_slice = [op for op in ops if not op.dcn]
    assert [op.groups for op in in_slice] == [[[0, 2], [1, 3]]]     # iota, transposed
    assert hlo.bytes_by_kind([op for op in ops if op.dcn]) == {
        "all-gather": 3 * 64, "all-reduce": 24576, "reduce-scatter": 0, "all-to-all": 0,
        "collective-permute": 0}


# ------------------------------------------------------------- the planner ----

def test_gradient_dcn_traffic_by_hand():
    """Data over 2 slices: the gradient all-reduce over G = data x context = 8 devices
    (bf16 matrices, f32 norms: W bytes) sends 2 W (D-1) / G over the DCN (a hierarchical
    all-reduce: the slice part on a 1/4 shard); the rest stays in the slice. The weight
    gathers (over Z = context, one slice) stay off the DCN."""
    sizes = {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    G, D = 8, 2
    grad_w = L * MATRICES * 2 + L * 2 * E * 4
    multi = planner.estimate(tiny("mesh.data=2", "mesh.context=4", "mesh.dcn_data=2"),
                             sizes, V5P, "ring")
    single = planner.estimate(tiny("mesh.data=2", "mesh.context=4"), sizes, V5P, "ring")
    detail = multi.comm_detail
    assert detail["gradients:dcn"] == pytest.approx(2 * grad_w * (D - 1) / G)
    assert detail["gradients"] + detail["gradients:dcn"] == pytest.approx(
        2 * grad_w * (G - 1) / G)
    assert "zero3_weights:dcn" not in detail and "strategy_ring:dcn" not in detail
    assert multi.comm_bytes == pytest.approx(single.comm_bytes)
    # The DCN part is timed at v5p's 50 Gb/s per chip instead of two 90 GB/s ICI links.
    dcn = dcn_bytes(detail)
    assert multi.comm_s - single.comm_s == pytest.approx(
        dcn / (50e9 / 8) - dcn / (2 * 90e9), rel=1e-9)


def test_weight_gather_dcn_traffic_by_hand():
    """fsdp over 2 slices: Z = fsdp x context = 8 spans D = 2 slices, so the weight gathers
    (2 per layer of the bf16 matrices, 6 of the f32 norms: W bytes gathered) send
    W (D-1) / Z over the DCN."""
    sizes = {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    Z, D = 8, 2
    gathered = 2 * L * MATRICES * 2 + 6 * L * E * 4
    detail = planner.estimate(tiny("mesh.data=1", "mesh.fsdp=2", "mesh.context=4",
                                   "mesh.dcn_fsdp=2"), sizes, V5P, "ring").comm_detail
    assert detail["zero3_weights:dcn"] == pytest.approx(gathered * (D - 1) / Z)
    assert detail["zero3_weights"] == pytest.approx(gathered * (Z - D) / Z)


# ------------------------------------------------------ against the compiler ----

@pytest.mark.slow
@needs_libtpu
def test_two_slice_train_step_sends_only_data_traffic_across_slices():
    """Ring attention (context 4) in each of two v5p:2x2x1 slices, data over both. XLA
    compiles one program per slice: its in-slice collectives name partitions 0-3, and what
    crosses slices is a megascale host transfer (parallel/hlo.py). Only the gradient
    all-reduces cross; every collective-permute of the ring stays in its slice, with the
    bytes the planner counts; the DCN bytes are at least the planner's floor."""
    from lctrain.parallel import aot, hlo
    from lctrain.trainer.state import build

    recipe = load_recipe("tiny", [*TINY, "data.seq_len=1024", "mesh.data=2", "mesh.context=4",
                                "mesh.dcn_data=2"])
    devices = aot.topology_devices("v5p:2x2x1", slices=2)
    text = build.compile_train_step(recipe, devices).as_text()
    ops, unknown = hlo.collective_ops(text)
    assert unknown == 0 and "num_partitions=4," in text
    in_slice = [op for op in ops if not op.dcn]
    across = [op for op in ops if op.dcn]
    assert all(set(sum(op.groups, [])) <= set(range(4)) for op in in_slice)
    assert {op.kind for op in across} == {"all-reduce"}
    assert all(op.groups == [[1, 2]] for op in across)              # both slices
    permutes = [op for op in ops if op.kind == "collective-permute"]
    assert permutes and not any(op.dcn for op in permutes)
    estimate = planner.estimate(recipe, {"data": 2, "fsdp": 1, "context": 4, "tensor": 1},
                                V5P, "ring")
    assert hlo.bytes_by_kind(permutes)["collective-permute"] == \
        estimate.comm_detail["strategy_ring"]
    compiled_dcn = sum(hlo.bytes_by_kind(across).values())
    floor = dcn_bytes(estimate.comm_detail)
    print(f"DCN bytes per device per step: compiled {compiled_dcn:,}, planner {floor:,.0f}")
    assert floor <= compiled_dcn <= 2 * floor
