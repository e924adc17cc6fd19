"""What `lctrain eval` shows of RULER: a table of score by task and length with the average
per length and the effective length, and a picture of score by length per task with the
threshold line (ruler.json holds the same numbers)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .table_fit import CONTINUED, stacked


def _cell(score: float | None) -> str:
    return "-" if score is None else f"{score:.1f}"


def effective_line(ruler: dict) -> str:
    threshold, effective = ruler["threshold"], ruler["effective_length"]
    if effective is None:
        return (f"effective length at {threshold}: none (the average at "
                f"{ruler['lengths'][0]:,} tokens is not above it)")
    return f"effective length at {threshold}: {effective:,} tokens"


def render_ruler(ruler: dict, console: Console) -> None:
    """One task per row, one length per column (stacked when the terminal is narrow)."""
    lengths = ruler["lengths"]
    title = (f"RULER ({ruler['source']}): score (%) by task (rows) and length (columns, "
             f"tokens), teacher-forced string_match_all (QA: string_match_part)")

    def table_of(columns: list[int], first: bool) -> Table:
        # The title goes above (a one-length table is too narrow for it).
        table = Table(title=None if first else CONTINUED, title_justify="left")
        table.add_column("task")
        for column in columns:
            table.add_column(f"{lengths[column]:,}", justify="right")
        for task in ruler["tasks"]:
            table.add_row(task, *(_cell(ruler["scores"][task][c]) for c in columns))
        table.add_row("average", *(_cell(ruler["average"][c]) for c in columns), style="bold")
        return table

    console.print(title, markup=False)
    for table in stacked(console, range(len(lengths)), table_of):
        console.print(table)
    console.print(effective_line(ruler))
    for task, why in ruler["skipped"].items():
        console.print(f"{task}: skipped, {why}")


def ruler_figure(ruler: dict, weights: str, pyplot):
    """Score by length (log x) per task and their average, with the threshold line."""
    figure, axis = pyplot.subplots(figsize=(8, 5))
    lengths = ruler["lengths"]
    for task in ruler["tasks"]:
        axis.plot(lengths, ruler["scores"][task], marker="o", linewidth=1, label=task)
    axis.plot(lengths, ruler["average"], color="black", linewidth=2.5, label="average")
    axis.axhline(ruler["threshold"], color="tab:red", linestyle="--",
                 label=f"threshold {ruler['threshold']}")
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths, [f"{length:,}" for length in lengths], rotation=45)
    axis.set_ylim(-2, 102)
    axis.set_xlabel("length (tokens)")
    axis.set_ylabel("score (%)")
    axis.set_title(f"RULER: {effective_line(ruler)}\n{weights}", fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    figure.tight_layout()
    return figure
