"""What `lctrain eval` shows: a console table by position, eval.json, and a PNG of loss
and accuracy against position (log x axis)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lctrain.trainer.outputs.files import written_into

from .ruler_report import render_ruler, ruler_figure
from .table_fit import CONTINUED, stacked


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
    if "ruler" in result:
        render_ruler(result["ruler"], console)


def _render_retrieval(retrieval: dict, console: Console) -> None:
    title = (f"{retrieval['task']} retrieval: share of the "
             f"{_samples(retrieval['samples_per_cell'])} per cell whose whole answer is the "
             f"argmax, by needle depth (rows, %) and haystack length (columns, tokens), as in "
             f"the heatmap")
    lengths, depths = retrieval["lengths"], retrieval["depths"]
    by_depth = depth_by_length(retrieval)

    def table_of(columns: list[int], first: bool) -> Table:
        table = Table(title=title if first else CONTINUED, title_justify="left")
        table.add_column("depth", justify="right")
        for column in columns:
            table.add_column(f"{lengths[column]:,}", justify="right")
        for depth, row in zip(depths, by_depth):
            table.add_row(f"{depth * 100:.0f}", *(f"{row[column]:.2f}" for column in columns))
        return table

    for table in stacked(console, range(len(lengths)), table_of):
        console.print(table)
    console.print(f"{retrieval['task']} accuracy over the grid: {retrieval['mean']:.3f}")


def depth_by_length(retrieval: dict) -> list[list[float]]:
    """The grid as the table and the heatmap show it, one row per needle depth and one
    column per haystack length (eval.json keeps it by length, then depth)."""
    return [list(column) for column in zip(*retrieval["accuracy"])]


def _samples(count: int) -> str:
    return f"{count} sample" + ("" if count == 1 else "s")


def eval_owns(name: str) -> bool:
    """Whether a file of this name is one `lctrain eval` writes (--overwrite replaces an
    earlier eval's, and nothing else in the folder)."""
    return (name in ("eval.json", "loss_by_position.png", "ruler.json", "ruler.png")
            or name.endswith("_heatmap.png"))


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    """eval.json and loss_by_position.png (and the retrieval heatmap, or RULER's ruler.json
    and ruler.png) in out_dir, in place of an earlier eval's; returns their paths."""
    names = ["eval.json", "loss_by_position.png"]
    with written_into(out_dir, eval_owns) as staging:
        (staging / names[0]).write_text(json.dumps(result, indent=2) + "\n")
        _save(by_position_figure(result), staging / names[1])
        if "retrieval" in result:
            names.append(f"{result['retrieval']['task']}_heatmap.png")
            _save(heatmap_figure(result["retrieval"], result["weights"]), staging / names[-1])
        if "ruler" in result:
            names += ["ruler.json", "ruler.png"]
            (staging / names[-2]).write_text(json.dumps(result["ruler"], indent=2) + "\n")
            _save(ruler_figure(result["ruler"], result["weights"], _pyplot()),
                  staging / names[-1])
    return [out_dir / name for name in names]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


# Cells up to this many get their value written in them (beyond, the text would not fit).
LABELLED_CELLS = 400


def heatmap_figure(retrieval: dict, weights: str):
    """The familiar needle-in-a-haystack picture: depth down, length across, green found;
    the title names the weights (run dir and step) and the samples behind each cell."""
    plt = _pyplot()
    accuracy = depth_by_length(retrieval)
    lengths, depths = retrieval["lengths"], retrieval["depths"]
    figure, axis = plt.subplots(figsize=(2.2 + 0.9 * len(lengths), 5))
    image = axis.imshow(accuracy, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    axis.set_xticks(range(len(lengths)), [f"{length:,}" for length in lengths], rotation=45)
    axis.set_yticks(range(len(depths)), [f"{depth:.0%}" for depth in depths])
    axis.set_xlabel("haystack length (tokens)")
    axis.set_ylabel("needle depth")
    axis.set_title(f"{retrieval['task']}: mean {retrieval['mean']:.2f}\n{weights}; "
                   f"{_samples(retrieval['samples_per_cell'])} per cell", fontsize=9)
    if len(lengths) * len(depths) <= LABELLED_CELLS:
        for row, values in enumerate(accuracy):
            for column, value in enumerate(values):
                # Dark text on the light middle of the colour map, white on its dark ends.
                axis.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7,
                          color="black" if 0.2 < value < 0.85 else "white")
    figure.colorbar(image, ax=axis, label="share retrieved")
    figure.tight_layout()
    return figure


def by_position_figure(result: dict):
    """Loss (with log(vocab) and the trained length marked) and accuracy by position."""
    plt = _pyplot()

    buckets = result["by_position"]
    kept = [i for i, tokens in enumerate(buckets["tokens"]) if tokens]
    # Each bucket drawn at its first position, counted from 1 for the log axis.
    starts = [buckets["edges"][i] + 1 for i in kept]
    losses = [buckets["loss"][i] for i in kept]
    figure, (loss_axis, accuracy_axis) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    loss_axis.plot(starts, losses, marker="o")
    loss_axis.set_ylabel("loss (nats)")
    loss_axis.set_title(f"{result['weights']}: loss and accuracy by position", fontsize=9)
    # log(vocab) is a uniform guess: a random model's flat curve sits on it, and the y range
    # starts at 0 and reaches it so that such a curve is not stretched into a trend.
    uniform = math.log(result["vocab"])
    loss_axis.axhline(uniform, color="tab:gray", linestyle=":",
                      label=f"log(vocab) = {uniform:.2f}, a uniform guess")
    loss_axis.set_ylim(0, 1.08 * max(uniform, *losses))
    trained = result.get("trained_seq_len")
    if trained and trained <= result["seq_len"]:
        for axis in (loss_axis, accuracy_axis):
            axis.axvline(trained, color="tab:red", linestyle="--",
                         label=f"trained length {trained:,}" if axis is loss_axis else None)
    loss_axis.legend(fontsize=8, loc="lower left")
    accuracy_axis.plot(starts, [buckets["accuracy"][i] for i in kept], marker="o",
                       color="tab:green")
    accuracy_axis.set_ylabel("next-token accuracy")
    accuracy_axis.set_ylim(-0.02, 1.02)
    accuracy_axis.set_xscale("log")
    accuracy_axis.set_xlabel("position in document (1 = first token)")
    for axis in (loss_axis, accuracy_axis):
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    return figure


def _save(figure, path: Path) -> None:
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)
