"""The attention kernel and blocks a recipe gets on a TPU generation when it leaves them
to lctrain (`attention.impl: auto`, `attention.block_q` / `block_kv` unset): the fastest
forward+backward measured on that chip. benchmarks/chip_check.py's `blocks` section
measures them; benchmarks/RESULTS.md ("Attention blocks per chip") has the rows behind
each entry. A generation nobody has timed keeps the kernels' own default blocks, and auto
its rule (kernels.impl_for_call: splash where its tiles fit, else pallas)."""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_BLOCK = 512


class Tiles(NamedTuple):
    impl: str
    block_q: int
    block_kv: int


# generation -> [(tokens per chip from which a row holds, tiles)], shortest first. On a
# v5e our kernel beats splash at its best blocks, and splash's dq kernel does not fit the
# 16 MiB of scoped VMEM with blocks of 1024 at 8K tokens.
MEASURED: dict[str, list[tuple[int, Tiles]]] = {
    "v5e": [(0, Tiles("pallas", 1024, 1024)), (32768, Tiles("pallas", 512, 2048))],
}


def measured(chip: str | None, tokens_per_chip: int) -> Tiles | None:
    """The fastest kernel and blocks measured on `chip` for that many tokens per chip, or
    None where the generation was not timed."""
    rows = [tiles for start, tiles in MEASURED.get(chip or "", []) if tokens_per_chip >= start]
    return rows[-1] if rows else None
