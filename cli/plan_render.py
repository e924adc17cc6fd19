"""`lctrain plan`'s tables: the planner's result (parallel/planner) for a terminal."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from lctrain.parallel.chips import gb_figure

from .table_fit import CONTINUED, stacked

if TYPE_CHECKING:
    from lctrain.parallel.planner import Plan, StrategyPlan


def _gb(x: float | None) -> str:
    return "-" if x is None else gb_figure(x)


def _seconds(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x >= 1e-3 else f"{x * 1e6:,.0f} us"


def plan_title(loaded, topology: str, slices: int, sizes: dict[str, int]) -> str:
    """The table's title: the model, its sequence and batch, the devices and the mesh."""
    where = topology + (f" x {slices} slices, dcn {loaded.mesh.dcn_sizes()}"
                        if slices > 1 else "")
    return (f"{loaded.model.name}, seq {loaded.data.seq_len:,}, batch {loaded.data.batch_size}, "
            f"{where}, mesh {sizes}, remat {loaded.remat.policy}")


def render(result: Plan, console, own_line: str | None = None, title: str = "") -> None:
    """The plan as a rich table, one row per strategy (the recipe's own first, where
    `own_line` compares it with the recommendation), then the recommendation. A table
    wider than the console is stacked: the same rows, a few column groups at a time."""
    from rich.markup import escape

    groups = _column_groups(result)
    # Escaped: a model folder (hf:<dir>) may hold square brackets, rich's markup.
    titled = escape(title) or None

    def table_of(taken: list[ColumnGroup], first: bool):
        return _table(result, own_line is not None, taken, titled if first else CONTINUED)

    for table in stacked(console, groups, table_of):
        console.print(table)
    for p in result.plans:
        if p.compile_failed:
            console.print(f"[yellow]{p.name}: {escape(p.compiled['error'])}[/] "
                          f"(docs/failures.md)", highlight=False, soft_wrap=True)
    for strategy, why in result.skipped.items():
        if strategy != "none":
            console.print(f"[dim]{strategy}: {escape(why)}[/]", highlight=False)
    if result.choice is not None:
        console.print(f"recommended: [bold]{result.choice.name}[/] - {escape(result.reason)}",
                      highlight=False, soft_wrap=True)
    if own_line:
        console.print(escape(own_line), highlight=False, soft_wrap=True)
    if result.choice is not None and result.choice.kinds:
        console.print(kinds_line(result.choice), highlight=False, soft_wrap=True)
    if result.note and not any(p.compiled is not None for p in result.plans):
        console.print(f"[yellow]note:[/] {escape(result.note)}", highlight=False,
                      soft_wrap=True)


# One group of the table's columns: their headers (name, justify) and each plan's cells.
ColumnGroup = tuple[tuple[tuple[str, str], ...], Callable[["StrategyPlan"], list[str]]]


def _column_groups(result: Plan) -> list[ColumnGroup]:
    """Memory, time, fits and (with --compile) XLA's figures: columns that are read
    together, kept in one table when the console is too narrow for all of them."""
    from lctrain.parallel.planner.traffic import dcn_bytes

    # Multi-slice: the part of the traffic that crosses slices (data-center network).
    dcn = {p.name: dcn_bytes(p.comm_detail) for p in result.plans}
    across_slices = any(dcn.values())
    groups: list[ColumnGroup] = [
        ((("HBM\nGB/device", "right"), ("host\nGB/device", "right"),
          ("comm\nGB/step", "right"),
          *([("of it DCN\nGB/step", "right")] if across_slices else [])),
         lambda p: [_gb(p.hbm_bytes), _gb(p.host_bytes), _gb(p.comm_bytes),
                    *([_gb(dcn[p.name])] if across_slices else [])]),
        ((("comm time /\ncompute time", "right"), ("MFU\nbound", "right"),
          ("ring\nhidden", "center")),
         lambda p: [f"{_seconds(p.comm_s)} / {_seconds(p.compute_s)}", f"{p.mfu_bound:.0%}",
                    {None: "-", True: "yes", False: "no"}[p.ring_hidden]]),
        ((("fits", "center"),), lambda p: ["[green]yes[/]" if p.fits else "[red]no[/]"]),
    ]
    if any(p.compiled is not None for p in result.plans):
        groups.append(((("XLA HBM\nGB/device", "right"), ("HBM\ngap", "right"),
                        ("XLA comm\nGB/step", "right"), ("comm\ngap", "right")),
                       _compiled_cells))
    return groups


def _table(result: Plan, recipe_first: bool, groups: list[ColumnGroup], title: str | None):
    """One table: the strategy column, then the groups' columns."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("strategy")  # may wrap: a map of layer kinds is long
    for headers, _ in groups:
        for name, justify in headers:
            table.add_column(name, justify=justify, no_wrap=True)
    for p in result.plans:
        own = recipe_first and p is result.plans[0]
        table.add_row(f"{p.name} (recipe)" if own else p.name,
                      *(cell for _, cells in groups for cell in cells(p)))
    return table


def _compiled_cells(p: StrategyPlan) -> list[str]:
    c = p.compiled_json() if p.compiled is not None else {}
    hbm_gap, comm_gap = c.get("hbm_gap_percent"), c.get("comm_gap_percent")
    return [_compiled_cell(p, c), "-" if hbm_gap is None else f"{hbm_gap:+.1f}%",
            _gb(c.get("compiled_comm_bytes_per_step")),
            "-" if comm_gap is None else f"{comm_gap:+.1f}%"]


def _compiled_cell(p, figures: dict) -> str:
    """XLA's HBM figure; OOM where the compiler refused the program for its size, failed
    where it refused it for another reason or died compiling it."""
    if figures.get("compiled_hbm_bytes_per_device") is not None:
        return _gb(figures["compiled_hbm_bytes_per_device"])
    return "failed" if p.compile_failed else "OOM"


def kinds_line(p) -> str:
    """The recommended plan per layer kind (model.layer_pattern): each kind's strategy and
    the traffic of its own collectives; the table's figures are the kinds' totals."""
    kinds = "; ".join(
        f"{kind} ({part.layers} layers{f', window {part.window:,}' if part.window else ''})"
        f": {p.kind_name(part.strategy)}, {_gb(part.comm_bytes)} GB/step of its own traffic"
        for kind, part in p.kinds.items())
    return f"per layer kind: {kinds}; the table's figures add up the kinds"


def render_max_seq(longest: dict[str, dict[str, int]], console) -> None:
    from rich.table import Table

    table = Table(title="longest sequence that fits", title_justify="left")
    table.add_column("strategy")
    table.add_column("estimated", justify="right")
    compiled = any("compiled" in v for v in longest.values())
    if compiled:
        table.add_column("compiled", justify="right")
    for name, figures in longest.items():
        row = [name, f"{figures['estimated']:,}"]
        if compiled:
            row.append(f"{figures['compiled']:,}")
        table.add_row(*row)
    console.print(table)
