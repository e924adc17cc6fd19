"""`lctrain eval`: the model's mean next-token loss on eval.source, forward only, on the
recipe's own mesh and context-parallel strategy (so it runs at any length it can train)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import Progress

from lctrain.parallel import make_strategy
from lctrain.recipes.schema import Recipe

from .data import make_source
from .loop import device_batch, mesh_for
from .step import build_trainable, make_loss_sums
from .weights import load_weights

# Evaluation batches are drawn with another seed than training's, so a synthetic task
# evaluates on sequences it never trained on. (Token files: a held-out split is still to do.)
EVAL_SEED_OFFSET = 1_000_003


def evaluate_loss(recipe: Recipe, run_dir: Path | None, step: int | None = None,
                  console: Console | None = None) -> dict:
    """{loss, perplexity, tokens, batches, weights} over eval.batches batches."""
    console = console or Console(quiet=True)
    mesh = mesh_for(recipe, console=console)
    trainable = build_trainable(recipe, mesh)
    params, origin = load_weights(recipe, trainable, run_dir, step)
    strategy = make_strategy(recipe, mesh)
    data = dataclasses.replace(recipe.data, source=recipe.eval.source or recipe.data.source)
    source = make_source(data, vocab=recipe.model.vocab,
                         seed=recipe.train.seed + EVAL_SEED_OFFSET)
    loss_sums = jax.jit(make_loss_sums(recipe, trainable.graphdef, strategy))
    order = strategy.sequence_order(recipe.data.seq_len)
    total = count = 0.0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"eval ({origin})", total=recipe.eval.batches)
        for index in range(recipe.eval.batches):
            batch_total, batch_count = loss_sums(params, device_batch(source, index, order,
                                                                      mesh))
            total, count = total + float(batch_total), count + float(batch_count)
            progress.advance(task)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count),
            "batches": recipe.eval.batches, "weights": origin}
