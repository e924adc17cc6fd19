"""The HLO collective counter (parallel/hlo.py) on hand-written HLO: each collective's
bytes by the convention in parallel/hlo.py, times the loops around it."""

from __future__ import annotations

from lctrain.kernels.scopes import layer_share_scope
from lctrain.parallel import hlo

HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%inner_cond (p: (s32[], bf16[2,8])) -> pred[] {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT, metadata={op_name="while/cond/lt"}
}

%inner_body (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %cp-start = (bf16[2,8]{1,0:T(8,128)(2,1)}, bf16[2,8]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done = bf16[2,8]{1,0:T(8,128)(2,1)} collective-permute-done(%cp-start), metadata={op_name="jit(step)/shard_map/while/body/ppermute" stack_frame_id=3}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[2,8]{1,0}) tuple(%next, %cp-done)
}

%outer_cond (p: (s32[], bf16[2,8])) -> pred[] {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  ROOT %unknown = pred[] custom-call(%p), custom_call_target="opaque"
}

%outer_body (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %zero = s32[] constant(0)
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %init = (s32[], bf16[2,8]{1,0}) tuple(%zero, %x)
  ROOT %inner = (s32[], bf16[2,8]{1,0}) while(%init), condition=%inner_cond, body=%inner_body
}

%gather_cond (p: (s32[], bf16[2,8])) -> pred[] {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %limit = s32[] constant(4)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %gt = pred[] compare(%limit, %i), direction=GT
}

%gather_body (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %ag-start = (bf16[2,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(%x), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %ag-done = bf16[8,8]{1,0} all-gather-done(%ag-start)
  ROOT %t = (s32[], bf16[2,8]{1,0}) tuple(%p, %x)
}

%reduce_branch (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
}

%skip_branch (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}

%wrapped_all_to_all (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %a2a = f32[4,4]{1,0} all-to-all(%p), replica_groups=mesh['x'=2,'y'=2] {'y'}, dimensions={0}, metadata={op_name="jit(step)/shard_map/all_to_all"}
}

ENTRY %main (x: bf16[2,8], y: f32[4,16], s: f32[], z: f32[4,4], w: f32[4,16], v: f32[4]) -> bf16[8,8] {
  %x = bf16[2,8]{1,0} parameter(0)
  %y = f32[4,16]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %z = f32[4,4]{1,0} parameter(3)
  %w = f32[4,16]{1,0} parameter(4)
  %v = f32[4]{0} parameter(5)
  %zero = s32[] constant(0)
  %start = s32[] constant(1)
  %outer_init = (s32[], bf16[2,8]{1,0}) tuple(%zero, %x)
  %outer = (s32[], bf16[2,8]{1,0}) while(%outer_init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"2"}}
  %gather_init = (s32[], bf16[2,8]{1,0}) tuple(%start, %x)
  %gathers = (s32[], bf16[2,8]{1,0}) while(%gather_init), condition=%gather_cond, body=%gather_body
  %ar = (f32[4,16]{1,0}, f32[]) all-reduce(%y, %s), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add
  %rs = f32[1,16]{1,0} reduce-scatter(%w), channel_id=4, replica_groups={}, dimensions={0}, to_apply=%add
  %which = s32[] constant(1)
  %branch = f32[4]{0} conditional(%which, %v, %v), branch_computations={%skip_branch, %reduce_branch}
  %a2a-start = ((f32[4,4]{1,0}), f32[4,4]{1,0}, s32[]) async-start(%z), calls=%wrapped_all_to_all
  %a2a-done = f32[4,4]{1,0} async-done(%a2a-start), calls=%wrapped_all_to_all
  ROOT %ag = bf16[8,8]{1,0} all-gather(%x), channel_id=5, replica_groups=[1,4]<=[4], dimensions={0}
}
"""


def test_shape_bytes():
    assert hlo.shape_bytes("bf16[1,1024,2,8]{1,3,2,0:T(8,128)(2,1)}") == 32768
    assert hlo.shape_bytes("(f32[4,16]{1,0}, f32[]{:T(128)}, /*index=2*/s32[3])") == 256 + 4 + 12
    assert hlo.shape_bytes("pred[]") == 1


def test_collective_bytes_of_hand_written_hlo():
    """Each expected figure: result bytes x the convention's factor x the loops around it."""
    counted = hlo.collective_bytes(HLO)
    assert counted.bytes_by_kind == {
        # 2 outer (known_trip_count) x 3 inner (counter 0 < 3) x bf16[2,8]; the -start
        # half of the async pair is not counted again.
        "collective-permute": 2 * 3 * 32,
        # loop: 4 > counter from 1 -> 3 trips of bf16[8,8] in groups of 4 (3/4 received);
        # plus ENTRY's synchronous all-gather of the same size.
        "all-gather": 3 * 128 * 3 // 4 + 128 * 3 // 4,
        # tuple (256 + 4 bytes) in groups of 2 (2 x 1/2), and the conditional's branch
        # f32[4] in one group of 4 (2 x 3/4).
        "all-reduce": 260 + 16 * 3 // 2,
        # replica_groups={} is all 4 partitions: 3 partial shards of f32[1,16] arrive.
        "reduce-scatter": 3 * 64,
        # inside an async wrapper, counted once; the group is mesh axis 'y' (2 devices).
        "all-to-all": 64 // 2,
    }
    # The outer loop's condition is opaque, but its known_trip_count covers it.
    assert counted.unknown_trip_counts == 0


def test_collectives_selected_by_op_name():
    counted = hlo.collective_bytes(HLO, op_name_contains="shard_map")
    assert counted.bytes_by_kind == {"collective-permute": 2 * 3 * 32, "all-to-all": 64 // 2,
                                     "all-gather": 0, "all-reduce": 0, "reduce-scatter": 0}


def test_a_layer_kinds_branch_counts_its_share_of_the_layer_scan():
    """The model's switch over layer kinds: a branch taken by 1 layer in 4 counts 1/4 of
    the runs around it (unrounded: a peeled scan step runs once)."""
    branch_all_reduce = "replica_groups={{0,1,2,3}}, to_apply=%add"
    assert HLO.count(branch_all_reduce) == 1
    scope = layer_share_scope("global", 1, 4)
    text = HLO.replace(branch_all_reduce, branch_all_reduce + ', metadata={op_name="jit(step)'
                       f'/while/body/cond/branch_1_fun/{scope}/psum"}}')
    assert hlo.collective_bytes(text).bytes_by_kind["all-reduce"] == 260 + (16 * 3 / 2) / 4


def test_unknown_trip_count_is_reported_and_counted_once():
    text = HLO.replace(', backend_config={"known_trip_count":{"n":"2"}}', "")
    counted = hlo.collective_bytes(text)
    assert counted.unknown_trip_counts == 1
    assert counted.bytes_by_kind["collective-permute"] == 3 * 32


def test_group_sizes():
    assert hlo._group_size("replica_groups={{0,2},{1,3}}, dimensions={0}", 4) == 2
    assert hlo._group_size("replica_groups=[2,4]<=[8]", 8) == 4
    assert hlo._group_size("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == 2
    assert hlo._group_size("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2] "
                           "{'axis_0','axis_1'}", 8) == 4
    assert hlo._group_size("replica_groups={}", 8) == 8
