"""What sits next to the Mosaic kernel calls of a compiled program: relayouts.

A Pallas kernel reads its operands in one layout (row-major tiles). When XLA has an
operand in another layout (it picks layouts for everything else itself, and across a
loop or a branch it may pick one for q that suits a matmul), it inserts a `copy` (or a
`transpose`) right before the kernel call, an HBM round trip of the whole tensor on
every call; under ring attention, on every ring step. Only floating-point tensors count
(q, k, v, out and gradients; not the kernels' integer tables). A relayout whose other
side is an all-to-all is marked: Ulysses' all-to-all delivers the sequence chunks
major ([b, chunk, heads, s/c, d]) and one copy per layer interleaves them per head. These functions find them in a
compiled module's text (parallel/hlo.py parses it): for every kernel call, the producer
of each large operand, looked through the ops that move no data (bitcast, tuple access,
the async copies that prefetch into faster memory), and the users of each large result.
"""

from __future__ import annotations

import dataclasses
import re

from lctrain.parallel.hlo import Instruction, parse_hlo_module, shape_bytes

# Ops that hand a buffer on without rewriting it.
_PASS_THROUGH = ("bitcast", "get-tuple-element", "copy-start", "copy-done")
_RELAYOUTS = ("copy", "transpose")
_FLOAT = re.compile(r"\(?(bf16|f16|f32|f64|f8)")


@dataclasses.dataclass(frozen=True)
class Relayout:
    kernel: str        # the kernel call's instruction name
    side: str          # "operand" or "result"
    index: int         # which operand, or which result of the call's tuple
    op: str            # the copy / transpose (or fusion ending in one)
    shape: str
    at_all_to_all: bool = False  # it reads an all-to-all's result, or feeds an all-to-all


def kernel_calls(hlo_text: str, names: tuple[str, ...]) -> list[str]:
    """Instruction names of the Mosaic calls of the kernels named `names`."""
    computations, _ = parse_hlo_module(hlo_text)
    return [i.name for body in computations.values() for i in body
            if _is_kernel_call(i, names)]


def relayouts_next_to_kernels(hlo_text: str, names: tuple[str, ...],
                              min_bytes: int) -> list[Relayout]:
    """Copies and transposes of at least `min_bytes` feeding or fed by the Mosaic calls
    of the kernels named `names` (their custom-call names, e.g. lctrain_flash_forward)."""
    computations, _ = parse_hlo_module(hlo_text)
    found = []
    for body in computations.values():
        by_name = {i.name: i for i in body}
        users = _users(body)
        for call in (i for i in body if _is_kernel_call(i, names)):
            for index, operand in enumerate(call.operands):
                producer = _producer(by_name, operand)
                if producer and _is_large_relayout(producer, computations, min_bytes):
                    found.append(Relayout(call.name, "operand", index, producer.name,
                                          producer.shape, _from_all_to_all(producer, by_name)))
            for index, result in _results(call, users):
                for user in users.get(result.name, []):
                    if _is_large_relayout(user, computations, min_bytes):
                        found.append(Relayout(call.name, "result", index, user.name,
                                              user.shape, _feeds_all_to_all(user, users)))
    return found


def _is_kernel_call(instruction: Instruction, names: tuple[str, ...]) -> bool:
    return ('custom_call_target="tpu_custom_call"' in instruction.attributes
            and any(instruction.name.startswith(name) for name in names))


def _users(body: list[Instruction]) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for instruction in body:
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction)
    return users


def _producer(by_name: dict[str, Instruction], name: str) -> Instruction | None:
    """The instruction that wrote the buffer `name` names, looked through pass-throughs;
    None when it comes from outside this computation (a parameter)."""
    instruction = by_name.get(name)
    while instruction is not None and instruction.opcode in _PASS_THROUGH:
        instruction = by_name.get(instruction.operands[0]) if instruction.operands else None
    return instruction


def _results(call: Instruction, users: dict[str, list[Instruction]]
             ) -> list[tuple[int, Instruction]]:
    """(result index, instruction) of the call itself and of the tuple accesses of its
    results."""
    accesses = [u for u in users.get(call.name, []) if u.opcode == "get-tuple-element"]
    return [(0, call), *((int(re.search(r"index=(\d+)", u.attributes).group(1)), u)
                         for u in accesses)]


def _is_all_to_all(instruction: Instruction | None) -> bool:
    return instruction is not None and instruction.opcode.startswith("all-to-all")


def _from_all_to_all(relayout: Instruction, by_name: dict[str, Instruction],
                     depth: int = 3) -> bool:
    """The relayout's input is an all-to-all's result, read directly or through a few
    fusions (e.g. splash's scaling of q)."""
    sources = [_producer(by_name, name) for name in relayout.operands]
    return any(_is_all_to_all(source) or (depth and source is not None
                                          and source.opcode == "fusion"
                                          and _from_all_to_all(source, by_name, depth - 1))
               for source in sources)


def _feeds_all_to_all(instruction: Instruction, users: dict[str, list[Instruction]]) -> bool:
    """An all-to-all reads `instruction`, directly or through pass-throughs."""
    for user in users.get(instruction.name, []):
        if _is_all_to_all(user) or (user.opcode in _PASS_THROUGH
                                    and _feeds_all_to_all(user, users)):
            return True
    return False


def _is_large_relayout(instruction: Instruction, computations, min_bytes: int) -> bool:
    if shape_bytes(instruction.shape) < min_bytes or not _FLOAT.match(instruction.shape):
        return False
    return _kind(instruction, computations) in _RELAYOUTS


def _kind(instruction: Instruction, computations) -> str:
    """The opcode, or for a fusion the opcode of its root (a fusion that only copies)."""
    if instruction.opcode != "fusion":
        return instruction.opcode
    called = re.search(r"calls=%([\w.\-]+)", instruction.attributes)
    body = computations.get(called.group(1), []) if called else []
    root = next((i for i in body if i.is_root), None)
    return root.opcode if root else "fusion"
