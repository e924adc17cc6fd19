"""Tables that fit the terminal: a table too wide for it is stacked as several, each
with the row labels and some of the columns, rather than left to rich, which cuts cells to
'…' (a number so cut cannot be read back)."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

G = TypeVar("G")

# The title of each table after the first: the same rows, the next columns.
CONTINUED = "(continued)"
UNBOUNDED = 1_000_000


def natural_width(console: Console, table: Table) -> int:
    """The width the table takes with no cell wrapped or cut (measured as if the console
    were unbounded: a measurement is clamped to the width it is given)."""
    return Measurement.get(console, console.options.update_width(UNBOUNDED), table).maximum


def stacked(console: Console, groups: Sequence[G],
            build: Callable[[list[G], bool], Table]) -> list[Table]:
    """Tables of consecutive column groups, as many groups in each as fit the console
    whole; build(groups, first) makes the table of those groups (first: the one that
    carries the title). A group too wide alone gets a table of its own."""
    tables, taken = [], []
    for group in groups:
        if taken and natural_width(console, build([*taken, group], not tables)) > console.width:
            tables.append(build(taken, not tables))
            taken = []
        taken.append(group)
    if taken:
        tables.append(build(taken, not tables))
    return tables
