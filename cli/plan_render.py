"""`lctrain plan`'s tables: the planner's result (parallel/planner) for a terminal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lctrain.parallel.chips import GB

if TYPE_CHECKING:
    from lctrain.parallel.planner import Plan


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:,.2f}"


def _seconds(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x >= 1e-3 else f"{x * 1e6:,.0f} us"


def render(result: Plan, console, own_line: str | None = None, title: str = "") -> None:
    """The plan as a rich table, one row per strategy (the recipe's own first, where
    `own_line` compares it with the recommendation), then the recommendation."""
    from rich.markup import escape
    from rich.table import Table

    from lctrain.parallel.planner.traffic import dcn_bytes

    compiled = any(p.compiled is not None for p in result.plans)
    # Multi-slice: the part of the traffic that crosses slices (data-center network).
    dcn = {p.name: dcn_bytes(p.comm_detail) for p in result.plans}
    across_slices = any(dcn.values())
    # Escaped: a model folder (hf:<dir>) may hold square brackets, rich's markup.
    table = Table(title=escape(title) or None, title_justify="left")
    for name, justify in (("strategy", "left"), ("HBM\nGB/device", "right"),
                          ("host\nGB/device", "right"), ("comm\nGB/step", "right"),
                          *([("of it DCN\nGB/step", "right")] if across_slices else []),
                          ("comm time /\ncompute time", "right"), ("MFU\nbound", "right"),
                          ("ring\nhidden", "center"), ("fits", "center")):
        table.add_column(name, justify=justify, no_wrap=True)
    if compiled:
        for name in ("XLA HBM\nGB/device", "HBM\ngap", "XLA comm\nGB/step", "comm\ngap"):
            table.add_column(name, justify="right", no_wrap=True)
    for p in result.plans:
        recipes = own_line is not None and p is result.plans[0]
        row = [f"{p.name} (recipe)" if recipes else p.name, _gb(p.hbm_bytes), _gb(p.host_bytes), _gb(p.comm_bytes),
               *([_gb(dcn[p.name])] if across_slices else []),
               f"{_seconds(p.comm_s)} / {_seconds(p.compute_s)}", f"{p.mfu_bound:.0%}",
               {None: "-", True: "yes", False: "no"}[p.ring_hidden],
               "[green]yes[/]" if p.fits else "[red]no[/]"]
        if compiled:
            c = p.compiled_json() if p.compiled is not None else {}
            hbm_gap, comm_gap = c.get("hbm_gap_percent"), c.get("comm_gap_percent")
            row += [_compiled_cell(p, c),
                    "-" if hbm_gap is None else f"{hbm_gap:+.1f}%",
                    _gb(c.get("compiled_comm_bytes_per_step")),
                    "-" if comm_gap is None else f"{comm_gap:+.1f}%"]
        table.add_row(*row)
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
    if result.note and not compiled:
        console.print(f"[yellow]note:[/] {escape(result.note)}", highlight=False,
                      soft_wrap=True)


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
