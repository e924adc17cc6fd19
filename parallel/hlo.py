"""Reading a compiled XLA module's text: its computations, while-loop trip counts and every
collective with the bytes one device receives (parallel/aot.py's compiled figures).

A multi-slice program is compiled per slice (num_partitions = the devices of one slice):
its in-slice collectives name partition ids; what crosses slices is a pair of host
transfers (send / recv, handler xla_megascale_runtime) whose frontend attributes give the
collective (_xla_megascale_transfer_type) and the slices or devices it spans
(_xla_megascale_target). Those count as DCN collectives.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from lctrain.kernels.scopes import LAYER_SHARE

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                    "collective-permute")

#
# Convention: the bytes ONE device RECEIVES per step, for a bandwidth-optimal algorithm in
# a group of n devices, from the collective's result buffer R (all of its arrays):
#   all-gather          R * (n-1)/n   (everything but its own share)
#   reduce-scatter      R * (n-1)     (the n-1 partial sums of its shard)
#   all-reduce          R * 2(n-1)/n  (reduce-scatter, then all-gather)
#   all-to-all          R * (n-1)/n   (everything but the block it keeps)
#   collective-permute  R             (one whole buffer from its source)
# Each instruction counts once per execution: times the trip counts of the while loops
# around it (both branches of a conditional count as taken, except a layer kind's branch:
# see layer_share_scope). Async pairs count once, at X-done (its shape is the result; n
# comes from the X-start it waits for); async-start / async-done wrappers are skipped and
# the collective inside the wrapped computation counts.

def _runs_in_branch(runs: int, op_name: str) -> float:
    """Its share of the runs, unrounded: XLA may peel a scan step out of the loop (it runs
    once, of a kind the text does not tell), so only the sum over the steps is exact."""
    share = LAYER_SHARE.search(op_name)
    return runs if share is None else runs * int(share.group(1)) / int(share.group(2))


_ELEMENT_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f8e3m4": 1,
}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_ELEMENT_BYTES, key=len, reverse=True))
                    + r")\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE_KEYS = ("body", "condition", "to_apply", "calls", "true_computation",
                "false_computation")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str          # result shape text, e.g. "bf16[1,1024,2,8]{...}" or "(f32[2], u32[])"
    opcode: str
    operands: list[str]
    operand_text: str   # the text inside the operand parentheses (a constant's literal)
    attributes: str     # everything after the operand list
    is_root: bool = False


@dataclasses.dataclass
class CollectiveCount:
    bytes_by_kind: dict[str, int]
    unknown_trip_counts: int


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape text (tuples summed; layouts ignored)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for dim in filter(None, (d.strip().lstrip("<=") for d in dims.split(","))):
            count *= int(dim)
        total += count * _ELEMENT_BYTES[dtype]
    return int(total)


def _matching(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    """Index just past the bracket that closes text[start] (which is `open_`)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_!r} in HLO: {text[start:start + 80]}")


def parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    is_root, name, rest = bool(match.group(1)), match.group(2), match.group(3)
    if rest.startswith("("):                     # tuple shape
        end = _matching(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    close = _matching(rest, paren)
    inside = rest[paren + 1:close - 1]
    operands = re.findall(r"%([\w.\-]+)", inside)
    return Instruction(name, shape, opcode, operands, inside, rest[close:], is_root)


def parse_hlo_module(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """{computation name: its instructions} and the ENTRY computation's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current = header.group(2)
                computations[current] = []
                if header.group(1):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            instruction = parse_instruction(line)
            if instruction:
                computations[current].append(instruction)
    return computations, entry


def _callees(instruction: Instruction) -> list[str]:
    if instruction.opcode in ("async-update", "async-done"):
        return []       # the wrapped computation runs once, counted at async-start
    names = [m.group(1) for key in _CALLEE_KEYS
             for m in re.finditer(rf"\b{key}=%([\w.\-]+)", instruction.attributes)]
    branches = re.search(r"branch_computations=\{([^}]*)\}", instruction.attributes)
    if branches:
        names += re.findall(r"%([\w.\-]+)", branches.group(1))
    return names


def while_trip_count(instruction: Instruction, caller: list[Instruction],
                     computations: dict[str, list[Instruction]]) -> int | None:
    """Trip count of a while op: XLA's known_trip_count when the backend config has it,
    else read from the loop condition `counter < N` (or <=, >, >=) and the counter's start
    in the init tuple (a constant; 0 when it cannot be found). None if neither works."""
    known = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', instruction.attributes)
    if known:
        return int(known.group(1))
    condition = re.search(r"\bcondition=%([\w.\-]+)", instruction.attributes)
    body = computations.get(condition.group(1), []) if condition else []
    by_name = {i.name: i for i in body}
    root = next((i for i in body if i.is_root), None)
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attributes)
    direction = direction.group(1) if direction else ""
    left, right = (by_name.get(name) for name in root.operands)
    if left is None or right is None:
        return None
    if left.opcode == "constant" and right.opcode == "get-tuple-element":
        left, right = right, left
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if left.opcode != "get-tuple-element" or right.opcode != "constant":
        return None
    limit = _constant_value(right)
    index = re.search(r"index=(\d+)", left.attributes)
    if limit is None or index is None:
        return None
    start = _counter_start(instruction, int(index.group(1)), caller)
    if direction == "LT":
        return max(limit - start, 0)
    if direction == "LE":
        return max(limit - start + 1, 0)
    return None


def _constant_value(instruction: Instruction) -> int | None:
    text = instruction.operand_text.strip()
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def _counter_start(while_op: Instruction, index: int, caller: list[Instruction]) -> int:
    by_name = {i.name: i for i in caller}
    init = by_name.get(while_op.operands[0]) if while_op.operands else None
    if init is not None and init.opcode == "tuple" and index < len(init.operands):
        start = by_name.get(init.operands[index])
        if start is not None and start.opcode == "constant":
            value = _constant_value(start)
            if value is not None:
                return value
    return 0


def replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
    """The partition ids of each group: {{0,1},{2,3}}; iota [groups,size]<=[dims]T(perm);
    mesh['a'=2,'b'=4] {'b'} (groups along the named axes of an iota mesh); a permute's
    source_target_pairs (each pair a group); {} or none: one group of all devices."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    if pairs:
        return _int_groups(pairs.group(1) + "}")
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        named = [list(sizes).index(a) for a in re.findall(r"'([^']+)'", mesh.group(2))]
        ids = np.arange(math.prod(map(int, sizes.values()))).reshape(
            [int(n) for n in sizes.values()])
        ids = np.moveaxis(ids, named, range(ids.ndim - len(named), ids.ndim))
        return ids.reshape(-1, math.prod(ids.shape[ids.ndim - len(named):])).tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                     attributes)
    if iota:
        ids = np.arange(int(iota.group(1)) * int(iota.group(2))).reshape(
            [int(d) for d in iota.group(3).split(",")])
        if iota.group(4):
            ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    explicit = re.search(r"replica_groups=\{(\{.*?\})\}", attributes)
    if explicit:
        return _int_groups(explicit.group(1))
    return [list(range(num_devices))]


def _int_groups(text: str) -> list[list[int]]:
    """'{0,1},{2,3}' -> [[0, 1], [2, 3]]; 'a:b' is the ids a to b (XLA's "{0:3}"), and a
    pair 'a->b' (a one-to-one transfer) the group [a, b]."""
    def ids(item: str) -> list[int]:
        first, _, last = item.partition(":")
        return list(range(int(first), int(last or first) + 1))

    return [sum((ids(item) for item in group.split(",")), [])
            for group in re.findall(r"\{([\d,:]+)\}", text.replace("->", ","))]


def _group_size(attributes: str, num_devices: int) -> int:
    return len(replica_groups(attributes, num_devices)[0])


# _xla_megascale_transfer_type -> the collective it carries out across slices.
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all",
                    "ONE_TO_ONE": "collective-permute"}


def megascale_transfer(instruction: Instruction) -> tuple[str, list[list[int]]] | None:
    """(collective kind, groups) of a cross-slice transfer counted at its recv (whose shape
    is the result): the groups are global device ids, or for XLA's shorthand
    "{1,2}x{0:3}" (every in-slice position of those slices) one group of slice numbers
    (1-based); None for any other instruction."""
    if instruction.opcode != "recv":
        return None
    kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', instruction.attributes)
    if not kind:
        return None
    target = re.search(r'_xla_megascale_target=(?:"\{([\d,:]+)\}x|\{(\{.*?\})\})',
                       instruction.attributes)
    groups = target and (_int_groups("{" + target.group(1) + "}") if target.group(1)
                         else _int_groups(target.group(2)))
    if not groups:
        raise ValueError(f"unreadable cross-slice target: {instruction.attributes[:300]}")
    return _MEGASCALE_KINDS[kind.group(1)], groups


def _received_bytes(kind: str, result_bytes: int, n: int) -> int:
    if n <= 1:
        return 0
    factor = {"all-gather": (n - 1) / n, "reduce-scatter": n - 1,
              "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n,
              "collective-permute": 1}[kind]
    return int(round(result_bytes * factor))


@dataclasses.dataclass
class CollectiveOp:
    kind: str
    received_bytes: int     # per execution, by the convention above
    runs: float             # executions per step (trip counts of the loops around it)
    op_name: str            # jax's name for where it comes from (metadata), "" if none
    groups: list[list[int]]  # replica_groups(), or for DCN megascale_transfer()'s groups
    dcn: bool = False       # crosses slices (a multi-slice program's host transfer)


def collective_ops(hlo_text: str) -> tuple[list[CollectiveOp], int]:
    """Every counted collective of the module, and how many while loops had a trip count
    that could not be read (counted as running once)."""
    computations, entry = parse_hlo_module(hlo_text)
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(partitions.group(1)) if partitions else 1
    runs, unknown = _runs_per_step(computations, entry)
    ops = []
    for name, times in runs.items():
        by_name = {i.name: i for i in computations[name]}
        for instruction in computations[name]:
            op = _collective_op(instruction, by_name, num_devices)
            if op:
                op.runs = _runs_in_branch(times, op.op_name)
                ops.append(op)
    return ops, unknown


def _runs_per_step(computations: dict[str, list[Instruction]], entry: str | None
                   ) -> tuple[dict[str, int], int]:
    """How often each computation runs per step (walking the call graph from ENTRY), and
    how many while loops had an unreadable trip count."""
    runs: dict[str, int] = {}
    unknown = 0

    def visit(name: str, times: int) -> None:
        nonlocal unknown
        runs[name] = runs.get(name, 0) + times
        for instruction in computations.get(name, []):
            callees = _callees(instruction)
            if not callees:
                continue
            factor = 1
            if instruction.opcode == "while":
                trips = while_trip_count(instruction, computations[name], computations)
                if trips is None:
                    unknown += 1
                factor = 1 if trips is None else trips
            for callee in callees:
                if callee in computations:
                    visit(callee, times * factor)

    visit(entry or next(iter(computations)), 1)
    return runs, unknown


def _collective_op(instruction: Instruction, by_name: dict[str, Instruction],
                   num_devices: int) -> CollectiveOp | None:
    """The collective an instruction counts as (runs = 1), or None."""
    transfer = megascale_transfer(instruction)
    if transfer:
        kind, groups = transfer
        result = _ARRAY.search(instruction.shape).group(0)   # (result, u32[], token[])
        return CollectiveOp(kind, _received_bytes(kind, shape_bytes(result), len(groups[0])),
                            1, "", groups, dcn=True)
    kind, start = _collective_kind(instruction, by_name)
    if not kind:
        return None
    groups = replica_groups(start.attributes, num_devices)
    op_name = (re.search(r'op_name="([^"]*)"', instruction.attributes)
               or re.search(r'op_name="([^"]*)"', start.attributes))
    received = _received_bytes(kind, shape_bytes(instruction.shape), len(groups[0]))
    return CollectiveOp(kind, received, 1, op_name.group(1) if op_name else "", groups)


def collective_bytes(hlo_text: str, op_name_contains: str | None = None) -> CollectiveCount:
    """Bytes one device receives per execution of the module, by collective kind (the
    convention is in the comment above); with `op_name_contains`, only collectives whose
    jax op_name contains it (e.g. "shard_map": those the strategies write themselves)."""
    ops, unknown = collective_ops(hlo_text)
    return CollectiveCount(bytes_by_kind(ops, op_name_contains), unknown)


def bytes_by_kind(ops: list[CollectiveOp], op_name_contains: str | None = None) -> dict[str, int]:
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for op in ops:
        if op_name_contains is None or op_name_contains in op.op_name:
            totals[op.kind] += op.runs * op.received_bytes
    return totals


def _collective_kind(instruction: Instruction,
                     by_name: dict[str, Instruction]) -> tuple[str | None, Instruction]:
    """(kind, the instruction carrying its replica groups) if the instruction is counted."""
    opcode = instruction.opcode
    if opcode in COLLECTIVE_KINDS:
        return opcode, instruction
    if opcode.endswith("-done") and opcode[:-5] in COLLECTIVE_KINDS:
        start = by_name.get(instruction.operands[0]) if instruction.operands else None
        return opcode[:-5], start or instruction
    return None, instruction
