"""What `lctrain eval` shows: a console table by position, eval.json, and a PNG of loss
and accuracy against position (log x axis)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table


def render_table(result: dict, console: Console) -> None:
    buckets = result["by_position"]
    edges = buckets["edges"]
    table = Table(title=f"{result['weights']}: {result['tokens']:,} tokens of "
                        f"{result['seq_len']:,}-token sequences", title_justify="left")
    for column in ("positions", "tokens", "loss", "perplexity", "accuracy"):
        table.add_column(column, justify="right")
    for i, tokens in enumerate(buckets["tokens"]):
        if tokens:
            loss = buckets["loss"][i]
            table.add_row(f"{edges[i]:,}-{edges[i + 1] - 1:,}", f"{tokens:,}", f"{loss:.4f}",
                          f"{2.718281828459045 ** loss:.2f}", f"{buckets['accuracy'][i]:.3f}")
    table.add_row("all", f"{result['tokens']:,}", f"{result['loss']:.4f}",
                  f"{result['perplexity']:.2f}", f"{result['accuracy']:.3f}", style="bold")
    console.print(table)


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    """eval.json and loss_by_position.png in out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out_dir / "eval.json", out_dir / "loss_by_position.png"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    _plot_by_position(result, plot_path)
    return [json_path, plot_path]


def _plot_by_position(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    buckets = result["by_position"]
    kept = [i for i, tokens in enumerate(buckets["tokens"]) if tokens]
    # Each bucket drawn at its first position, counted from 1 for the log axis.
    starts = [buckets["edges"][i] + 1 for i in kept]
    figure, (loss_axis, accuracy_axis) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    loss_axis.plot(starts, [buckets["loss"][i] for i in kept], marker="o")
    loss_axis.set_ylabel("loss (nats)")
    loss_axis.set_title(f"{result['weights']}: loss and accuracy by position")
    accuracy_axis.plot(starts, [buckets["accuracy"][i] for i in kept], marker="o",
                       color="tab:green")
    accuracy_axis.set_ylabel("next-token accuracy")
    accuracy_axis.set_ylim(-0.02, 1.02)
    accuracy_axis.set_xscale("log")
    accuracy_axis.set_xlabel("position in document (1 = first token)")
    for axis in (loss_axis, accuracy_axis):
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
