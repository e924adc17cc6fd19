"""What `lctrain eval` shows: a console table by position, eval.json, and a PNG of loss
and accuracy against position (log x axis)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def render_table(result: dict, console: Console) -> None:
    buckets = result["by_position"]
    edges = buckets["edges"]
    # Escaped: the weights' run dir or model folder may hold square brackets, rich's markup.
    table = Table(title=f"{escape(result['weights'])}: {result['tokens']:,} tokens of "
                        f"{result['seq_len']:,}-token sequences", title_justify="left")
    for column in ("positions", "tokens", "loss", "perplexity", "accuracy"):
        table.add_column(column, justify="right")
    for i, tokens in enumerate(buckets["tokens"]):
        if tokens:
            loss = buckets["loss"][i]
            table.add_row(f"{edges[i]:,}-{edges[i + 1] - 1:,}", f"{tokens:,}", f"{loss:.4f}",
                          f"{math.exp(loss):.2f}", f"{buckets['accuracy'][i]:.3f}")
    table.add_row("all", f"{result['tokens']:,}", f"{result['loss']:.4f}",
                  f"{result['perplexity']:.2f}", f"{result['accuracy']:.3f}", style="bold")
    console.print(table)
    if "retrieval" in result:
        _render_retrieval(result["retrieval"], console)


def _render_retrieval(retrieval: dict, console: Console) -> None:
    table = Table(title=f"{retrieval['task']} retrieval: share of {retrieval['samples_per_cell']} "
                        f"samples whose whole answer is the argmax, by haystack length (rows) "
                        f"and needle depth (columns, %)", title_justify="left")
    table.add_column("length", justify="right")
    for depth in retrieval["depths"]:
        table.add_column(f"{depth * 100:.0f}", justify="right")
    for length, row in zip(retrieval["lengths"], retrieval["accuracy"]):
        table.add_row(f"{length:,}", *(f"{value:.2f}" for value in row))
    console.print(table)
    console.print(f"{retrieval['task']} accuracy over the grid: {retrieval['mean']:.3f}")


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    """eval.json and loss_by_position.png in out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out_dir / "eval.json", out_dir / "loss_by_position.png"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    _plot_by_position(result, plot_path)
    written = [json_path, plot_path]
    if "retrieval" in result:
        written.append(out_dir / f"{result['retrieval']['task']}_heatmap.png")
        _plot_heatmap(result["retrieval"], written[-1])
    return written


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _plot_heatmap(retrieval: dict, path: Path) -> None:
    """The familiar needle-in-a-haystack picture: depth down, length across, green found."""
    plt = _pyplot()
    accuracy = [list(column) for column in zip(*retrieval["accuracy"])]  # depth x length
    figure, axis = plt.subplots(figsize=(1.2 + 0.9 * len(retrieval["lengths"]), 5))
    image = axis.imshow(accuracy, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    axis.set_xticks(range(len(retrieval["lengths"])),
                    [f"{length:,}" for length in retrieval["lengths"]], rotation=45)
    axis.set_yticks(range(len(retrieval["depths"])),
                    [f"{depth:.0%}" for depth in retrieval["depths"]])
    axis.set_xlabel("haystack length (tokens)")
    axis.set_ylabel("needle depth")
    axis.set_title(f"{retrieval['task']}: mean {retrieval['mean']:.2f}")
    figure.colorbar(image, ax=axis, label="retrieved")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_by_position(result: dict, path: Path) -> None:
    plt = _pyplot()

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
