"""Compile a recipe's train step for a TPU topology without a TPU (libtpu ahead-of-time).

With libtpu installed, `jax.experimental.topologies` describes the chips of e.g.
"v5p:2x2x1" on any machine; jit(...).lower(abstract args).compile() then runs XLA's real
TPU compiler, and the compiled program tells per-chip memory (`memory_analysis()`) and,
in its HLO text, every collective it will run. Nothing is materialised: parameters, state
and batch are ShapeDtypeStructs, so an 8B or 70B recipe compiles on a laptop.

Run with JAX_PLATFORMS=cpu (the topology devices need no TPU backend).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import jax.numpy as jnp

from lctrain.parallel.native_stderr import shown_only_on_failure
from lctrain.recipes.schema import Recipe

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                    "collective-permute")

# ------------------------------------------------------------------ devices ----

def topology_devices(name: str) -> list:
    """The devices of a TPU topology such as "v5p:2x2x1", "v5e:2x2", "v6e:16x16" (no TPU
    needed, but libtpu is)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise RuntimeError(f"compiling for TPU topology '{name}' needs libtpu; install the "
                           f"tpu extra: pip install -e '.[tpu]'") from None
    # libtpu takes a machine-wide lock file when it loads, so that two processes do not
    # drive the same chips; an ahead-of-time compile drives none, so do not wait for (or
    # fail on) another process that holds it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    try:
        with shown_only_on_failure():  # libtpu loads here, warning that it finds no TPU
            return list(topologies.get_topology_desc(platform="tpu",
                                                     topology_name=name).devices)
    except Exception as err:  # libtpu's message for an unknown name is long and generic
        raise ValueError(f"unknown TPU topology '{name}' (e.g. v4:2x2x1, v5e:2x2, v5p:2x2x1, "
                         f"v6e:2x2, tpu7x:2x2x1): {str(err).splitlines()[0]}") from err


# ------------------------------------------------------------------ compile ----

def compile_train_step(recipe: Recipe, devices) -> Any:
    """The compiled train step (jax.stages.Compiled) of `recipe` on `devices`, built as the
    real run builds it (trainer.loop.mesh_for, make_strategy, build_trainable,
    make_train_step), lowered with abstract state and batch only."""
    from lctrain.parallel import make_strategy
    from lctrain.trainer.loop import mesh_for
    from lctrain.trainer.step import build_trainable, make_train_step

    mesh = mesh_for(recipe, devices)
    strategy = make_strategy(recipe, mesh)
    trainable = build_trainable(recipe, mesh)
    train_step = make_train_step(recipe, trainable, strategy, mesh)
    return train_step.lower(trainable.abstract_state, abstract_batch(recipe, mesh)).compile()


def compile_eval_step(recipe: Recipe, devices) -> Any:
    """The compiled evaluation step of `lctrain eval` (forward only, loss and accuracy by
    position at eval.seq_len) on `devices`, lowered with abstract parameters and batch."""
    from lctrain.parallel import make_strategy
    from lctrain.trainer.evaluate import make_bucket_sums, position_edges
    from lctrain.trainer.loop import mesh_for
    from lctrain.trainer.step import build_trainable

    mesh = mesh_for(recipe, devices)
    recipe = recipe.for_evaluation()
    trainable = build_trainable(recipe, mesh)
    bucket_sums = jax.jit(make_bucket_sums(recipe, trainable.graphdef,
                                           make_strategy(recipe, mesh),
                                           position_edges(recipe.data.seq_len)))
    return bucket_sums.lower(trainable.abstract_state.params,
                             abstract_batch(recipe, mesh)).compile()


def abstract_batch(recipe: Recipe, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch's shapes, dtypes and shardings, for lowering without data."""
    from lctrain.trainer.step import BATCH_FIELDS, batch_shardings

    shape = (recipe.data.batch_size, recipe.data.seq_len)
    shardings = batch_shardings(mesh)
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32 if name == "loss_mask" else jnp.int32,
                                       sharding=shardings[name])
            for name in BATCH_FIELDS}


# -------------------------------------------------------------------- stats ----

@dataclasses.dataclass
class CompiledStats:
    """Per-chip figures of one compiled program."""
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    host_temp_bytes: int
    host_argument_bytes: int
    generated_code_bytes: int
    # Bytes one chip receives per step, by collective kind (see collective_bytes()): all
    # of them, and those whose jax op_name is inside a shard_map (what the context-parallel
    # strategy sends itself; the rest is parameter gathers, gradient reductions and what
    # XLA's partitioner adds). A collective XLA rewrites can lose its op_name (e.g. a
    # reduce-scatter turned into an all-reduce) and then only counts in the first dict.
    collective_bytes: dict[str, int]
    shard_map_collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # While loops whose trip count could not be read (counted as running once).
    unknown_trip_counts: int = 0

    @property
    def hbm_bytes(self) -> int:
        """Peak HBM of the step on one chip: arguments + outputs + temporaries - aliased.

        memory_analysis() counts a donated argument that an output reuses (the train state)
        in argument_size AND in output_size, and reports the reused bytes as alias_size, so
        they are subtracted once; temp_size is the peak of everything else XLA allocates
        (activations, gradients, scratch). The program binary (generated_code_bytes, a few
        MB) is left out.
        """
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def compiled_stats(compiled) -> CompiledStats:
    memory = compiled.memory_analysis()
    ops, unknown = collective_ops(compiled.as_text())
    return CompiledStats(
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        host_temp_bytes=memory.host_temp_size_in_bytes,
        host_argument_bytes=memory.host_argument_size_in_bytes,
        generated_code_bytes=memory.generated_code_size_in_bytes,
        collective_bytes=bytes_by_kind(ops),
        shard_map_collective_bytes=bytes_by_kind(ops, "shard_map"),
        unknown_trip_counts=unknown,
    )


# --------------------------------------------------------------- HLO parsing ----
#
# Convention: the bytes ONE device RECEIVES per step, for a bandwidth-optimal algorithm in
# a group of n devices, from the collective's result buffer R (all of its arrays):
#   all-gather          R * (n-1)/n   (everything but its own share)
#   reduce-scatter      R * (n-1)     (the n-1 partial sums of its shard)
#   all-reduce          R * 2(n-1)/n  (reduce-scatter, then all-gather)
#   all-to-all          R * (n-1)/n   (everything but the block it keeps)
#   collective-permute  R             (one whole buffer from its source)
# Each instruction counts once per execution: times the trip counts of the while loops
# around it (both branches of a conditional count as taken). Async pairs count once, at
# X-done (its shape is the result; n comes from the X-start it waits for); async-start /
# async-done wrappers are skipped and the collective inside the wrapped computation counts.

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


def _group_size(attributes: str, num_devices: int) -> int:
    """Devices per replica group: {{0,1,2,3},...}, iota [groups,size]<=[...], or
    mesh['a'=2,'b'=4] {'b'} (product of the named axes)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        size = 1
        for axis in re.findall(r"'([^']+)'", mesh.group(2)):
            size *= int(sizes[axis])
        return size
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
    if iota:
        return int(iota.group(2))
    explicit = re.search(r"replica_groups=\{\{([^}]*)\}", attributes)
    if explicit:
        return len(explicit.group(1).split(","))
    return num_devices      # replica_groups={} (or absent): one group of all devices


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
    runs: int               # executions per step (trip counts of the loops around it)
    op_name: str            # jax's name for where it comes from (metadata), "" if none


def collective_ops(hlo_text: str) -> tuple[list[CollectiveOp], int]:
    """Every counted collective of the module, and how many while loops had a trip count
    that could not be read (counted as running once)."""
    computations, entry = parse_hlo_module(hlo_text)
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(partitions.group(1)) if partitions else 1

    # How often each computation runs per step: walk the call graph from ENTRY.
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

    ops = []
    for name, times in runs.items():
        by_name = {i.name: i for i in computations[name]}
        for instruction in computations[name]:
            kind, start = _collective_kind(instruction, by_name)
            if kind:
                n = _group_size(start.attributes, num_devices)
                op_name = (re.search(r'op_name="([^"]*)"', instruction.attributes)
                           or re.search(r'op_name="([^"]*)"', start.attributes))
                received = _received_bytes(kind, shape_bytes(instruction.shape), n)
                ops.append(CollectiveOp(kind, received, times,
                                        op_name.group(1) if op_name else ""))
    return ops, unknown


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
