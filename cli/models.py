"""`lctrain export` and `lctrain eval`: a trained model out to Hugging Face, and how well it
predicts each position."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from lctrain.recipes import load_recipe, load_run_recipe
from lctrain.trainer.data.checks import check_data
from lctrain.trainer.data.provenance import (check_against_record, read_record, run_init_folder,
                                             shipped_tokenizer)
from lctrain.trainer.outputs.files import check_target, kept_for_run
from lctrain.trainer.train.runtime import start

from .common import (COORDINATOR, NUM_PROCESSES, PROCESS_ID, SETS, app, attempt, console,
                     default_run_dir, error_console, fail, wide_console)
from .eval_report import render_table, write_outputs

DTYPES = ("bfloat16", "float32")


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="The run dir `lctrain run` trained into."),
    out_dir: Path = typer.Argument(..., help="Folder to write the Hugging Face model into."),
    step: Optional[int] = typer.Option(None, help="Checkpoint step (default: the latest)."),
    dtype: str = typer.Option("bfloat16", help="Weights' dtype on disk: bfloat16 or float32."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Write into OUT_DIR when it holds files, replacing an "
                                   "earlier export's files there and nothing else (never in "
                                   "the run dir, its data's or model.init's folder)."),
    no_tokenizer: bool = typer.Option(
        False, "--no-tokenizer", help="Write no tokenizer files: needed when neither the run "
                                      "dir nor model.init's folder holds the tokenizer."),
    set_: list[str] = SETS,
    coordinator: Optional[str] = COORDINATOR,
    num_processes: Optional[int] = NUM_PROCESSES,
    process_id: Optional[int] = PROCESS_ID,
) -> None:
    """Write a run's checkpoint as a Hugging Face model folder (config.json with the run's
    RoPE and eos/bos ids, sharded safetensors, the tokenizer files the run dir recorded, else
    model.init's)."""
    if dtype not in DTYPES:
        fail(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    # Export reads weights only: the run's training data may be long gone.
    recipe = attempt(lambda: load_run_recipe(run_dir, set_))
    tokenizer = attempt(lambda: shipped_tokenizer(run_dir, no_tokenizer))
    attempt(lambda: check_target(out_dir, overwrite, "OUT_DIR", _kept(recipe, run_dir),
                                 folder=True))
    start(recipe.runtime.cpu_devices, coordinator, num_processes, process_id)
    import jax

    from lctrain.trainer.hf.export import export_run

    files, origin = attempt(lambda: export_run(recipe, run_dir, out_dir, step, dtype,
                                               error_console, tokenizer))
    if jax.process_index() == 0:
        shipped = f"; tokenizer from {tokenizer.origin}" if tokenizer.origin else ""
        console.print(f"exported {origin} to {out_dir}: {', '.join(files)}{shipped}",
                      soft_wrap=True, markup=False)


def _kept(recipe, run_dir: Path) -> dict[str, Path]:
    """What an output of this run's command must not write over, its tokenizer's folder
    among them."""
    record = read_record(run_dir)
    return kept_for_run(recipe, run_dir, recipe.model.hf_dir or run_init_folder(run_dir),
                        record.copied_from if record else None)


@app.command(name="eval")
def eval_(
    recipe: Optional[str] = typer.Argument(
        None, help="Recipe YAML file or built-in name (default: the run dir's recipe, else "
                   "the built-in 'quickstart')."),
    run_dir: Optional[Path] = typer.Option(
        None, help="Run dir whose checkpoint to evaluate (default: runs/<recipe name>); "
                   "without a checkpoint there, model.init's weights."),
    step: Optional[int] = typer.Option(None, help="Checkpoint step (default: the latest)."),
    set_: list[str] = SETS,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    out: Optional[Path] = typer.Option(
        None, help="Folder for eval.json, loss_by_position.png and, with eval.task needle "
                   "or passkey, <task>_heatmap.png (default: <run dir>/eval, replaced each "
                   "time; never the run dir, its data's or model.init's folder)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Write into --out when it holds files, replacing an "
                                   "earlier eval's files there and nothing else."),
    coordinator: Optional[str] = COORDINATOR,
    num_processes: Optional[int] = NUM_PROCESSES,
    process_id: Optional[int] = PROCESS_ID,
) -> None:
    """Loss, perplexity and next-token accuracy of a model, overall and by position, on
    eval.source (default data.source), forward only, on the recipe's mesh and strategy.
    With eval.task needle or passkey, also retrieval of a needle (a key-value sentence, or
    five digits) by haystack length and depth: a table and <task>_heatmap.png, one depth
    per row and one length per column. With eval.task ruler (or one RULER task, or
    eval.samples), RULER's scores by task and length, their average and the effective
    length: a table, ruler.json and ruler.png. Writes eval.json and loss_by_position.png
    (docs/evaluation.md)."""
    run_dir = run_dir or default_run_dir(recipe)
    from_run = recipe is None and (run_dir / "recipe.yaml").is_file()
    loaded = attempt(lambda: check_data(load_run_recipe(run_dir, set_) if from_run
                                        else load_recipe(recipe, set_)))
    attempt(lambda: check_against_record(loaded.for_evaluation().data, run_dir, "eval"))
    if out is not None:  # the default, the run dir's own eval/, is eval's to replace
        attempt(lambda: check_target(out, overwrite, "--out", _kept(loaded, run_dir),
                                     folder=True))
    start(loaded.runtime.cpu_devices, coordinator, num_processes, process_id)
    import jax

    from lctrain.trainer.evaluation.evaluate import evaluate

    # Progress on stderr: stdout keeps only the table or the JSON.
    result = attempt(lambda: evaluate(loaded, run_dir, step, error_console))
    if jax.process_index() != 0:
        return
    written = write_outputs(result, out or run_dir / "eval")
    if as_json:
        typer.echo(json.dumps(result))
        return
    render_table(result, wide_console())
    console.print(f"wrote {', '.join(map(str, written))}", markup=False, soft_wrap=True)
