"""`lctrain eval`: how well the model predicts each position of a long window, forward
only, on the recipe's own mesh and context-parallel strategy (so it runs at any length it
can train, and longer: eval.seq_len).

Every counted token contributes its cross-entropy and whether its target was the argmax,
summed on the device into log-spaced buckets of its position in its document (the RoPE
position the prediction is made at), so only a few numbers per batch reach the host.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from lctrain.parallel import make_strategy
from lctrain.recipes.schema import Recipe
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.evaluation.retrieval import OneBatch, cell_batches, grid
from lctrain.trainer.evaluation.ruler import (cell_score, check_eval_task, group_skips,
                                              is_ruler, ruler_cells, ruler_lengths,
                                              ruler_summary)
from lctrain.trainer.hf.weights import load_weights
from lctrain.trainer.model.loss import token_scores
from lctrain.trainer.outputs.progress import Bar, tracked
from lctrain.trainer.state.build import abstract_batch, device_batch, resolved_mesh
from lctrain.trainer.state.step import build_trainable, make_forward

POSITION_BUCKETS = 16


def position_edges(seq_len: int, buckets: int = POSITION_BUCKETS) -> np.ndarray:
    """Bucket edges 0 = e0 < e1 < ... < seq_len, log-spaced (position p is in bucket i when
    e_i <= p < e_i+1): the first positions one per bucket, the long tail coarser."""
    inner = np.round(np.geomspace(1, seq_len, buckets)).astype(np.int64)
    return np.unique(np.concatenate([[0], inner, [seq_len]]))


def make_bucket_sums(recipe: Recipe, graphdef, strategy, edges: np.ndarray):
    """(params, batch) -> {loss, correct, tokens}, each summed per position bucket."""
    forward = make_forward(recipe, graphdef, strategy)
    edges = jnp.asarray(edges, jnp.int32)

    def bucket_sums(params, batch):
        model, hidden = forward(params, batch)
        losses, correct = token_scores(hidden, model.output_weights(), batch["targets"],
                                       recipe.loss, strategy.sequence_shards)
        mask = batch["loss_mask"].astype(jnp.float32)
        bucket = (jnp.searchsorted(edges, batch["positions"], side="right") - 1).ravel()

        def per_bucket(values):
            return jax.ops.segment_sum((values * mask).ravel(), bucket,
                                       num_segments=edges.shape[0] - 1)

        return {"loss": per_bucket(losses), "correct": per_bucket(correct),
                "tokens": per_bucket(jnp.ones_like(mask))}

    return bucket_sums


class Evaluator:
    """Evaluation on the held-out batches (the same eval.batches each time), compiled once
    for the mesh; called with the parameters, it returns what `summary` describes."""

    def __init__(self, recipe: Recipe, mesh, graphdef):
        self.trained_seq_len = recipe.data.seq_len
        self.recipe = recipe.for_evaluation()
        data = self.recipe.data
        self.mesh = mesh
        # Its own strategy: eval.seq_len may cut the sequence into other chunks.
        strategy = make_strategy(self.recipe, mesh)
        self.source = make_source(data, vocab=self.recipe.model.vocab,
                                  seed=self.recipe.train.seed, split="eval",
                                  holdout=recipe.eval.data_holdout)
        self.edges = position_edges(data.seq_len)
        self.bucket_sums = jax.jit(make_bucket_sums(self.recipe, graphdef, strategy,
                                                    self.edges))
        self.order = strategy.sequence_order(data.seq_len)
        self.string_misses = jax.jit(make_string_misses(self.recipe, graphdef, strategy),
                                     static_argnums=2)
        self.slots = first_slots(self.recipe)

    def __call__(self, params, origin: str, console: Console | None = None) -> dict:
        totals = {name: np.zeros(len(self.edges) - 1) for name in ("loss", "correct", "tokens")}
        batches = self.recipe.eval.batches
        for index in tracked(console, range(batches), f"eval ({origin})"):
            batch = device_batch(self.source, index, self.order, self.mesh)
            for name, values in jax.device_get(self.bucket_sums(params, batch)).items():
                totals[name] += values
        result = summary(totals, self.edges, self.recipe, origin)
        result["trained_seq_len"] = self.trained_seq_len
        if is_ruler(self.recipe):
            result["ruler"] = self.ruler(params, origin, console)
        elif self.recipe.eval.task != "loss":
            result["retrieval"] = self.retrieval(params, origin, console)
        return result

    def found(self, params, batch, strings: int) -> np.ndarray:
        """Whether each of the batch's expected strings (ids 1..strings in its loss mask)
        had every token the argmax."""
        source = OneBatch(self.recipe.data, batch)
        # One static size for the whole pass, each compile being a forward pass's (RULER's
        # cells hold 8 to 320 strings on the default recipe: one compile per power of two
        # was 6); it doubles only when a batch holds more strings than any before.
        while strings >= self.slots:
            self.slots *= 2
        misses = jax.device_get(self.string_misses(
            params, device_batch(source, 0, self.order, self.mesh), self.slots))
        return misses[1:strings + 1] == 0

    def ruler(self, params, origin: str, console: Console | None = None) -> dict:
        """RULER's score (%) per task and length, their averages and the effective length."""
        data = self.recipe.data
        filler = self.source if data.sources or data.source != "synthetic" else None
        scores: dict[str, dict[int, tuple[float, int]]] = {}
        unfit = group_skips(self.recipe)
        count, cells = ruler_cells(self.recipe, filler, self.recipe.train.seed, unfit)
        with Bar(console, f"ruler ({origin})", count) as bar:
            for task, length, samples in cells:
                score = cell_score(samples, functools.partial(self.found, params),
                                   data.seq_len, data.batch_size, length)
                scores.setdefault(task, {})[length] = (score, len(samples))
                bar.advance()
        return ruler_summary(scores, self.recipe, unfit)

    def retrieval(self, params, origin: str, console: Console | None = None) -> dict:
        """Share of samples retrieved per (haystack length, needle depth)."""
        lengths, depths = grid(self.recipe)
        accuracy = np.zeros((len(lengths), len(depths)))
        data = self.recipe.data
        filler = self.source if data.sources or data.source != "synthetic" else None
        cells = cell_batches(self.recipe, filler, self.recipe.train.seed)
        with Bar(console, f"{self.recipe.eval.task} ({origin})", accuracy.size) as bar:
            for cell, (_, _, batch) in enumerate(cells):
                accuracy.flat[cell] = float(np.mean(self.found(params, batch,
                                                               batch.inputs.shape[0])))
                bar.advance()
        return {"task": self.recipe.eval.task, "lengths": lengths, "depths": depths,
                "accuracy": accuracy.tolist(), "mean": float(accuracy.mean()),
                "samples_per_cell": self.recipe.data.batch_size}


def first_slots(recipe: Recipe) -> int:
    """String ids a batch can hold (0, not counted, and 1...), for every batch of a pass:
    a power of two above a batch of RULER's shortest samples with 10 strings each (cwe's,
    the most of a generated task; a retrieval batch has one a row)."""
    shortest = ruler_lengths(recipe)[0] if is_ruler(recipe) else recipe.data.seq_len
    return 1 << (recipe.data.batch_size * (recipe.data.seq_len // shortest) * 10).bit_length()


def make_string_misses(recipe: Recipe, graphdef, strategy):
    """(params, batch, slots) -> per string id (the loss mask's values; 0 is not counted)
    the number of its tokens that were not the argmax: 0 is a string found."""
    forward = make_forward(recipe, graphdef, strategy)

    def string_misses(params, batch, slots: int):
        model, hidden = forward(params, batch)
        _, correct = token_scores(hidden, model.output_weights(), batch["targets"],
                                  recipe.loss, strategy.sequence_shards)
        ids = batch["loss_mask"].astype(jnp.int32).ravel()
        return jax.ops.segment_sum((1 - correct).ravel(), ids, num_segments=slots)

    return string_misses


def evaluate(recipe: Recipe, run_dir: Path | None, step: int | None = None,
             console: Console | None = None) -> dict:
    """`lctrain eval`: the run dir's checkpoint (or model.init's weights) evaluated."""
    check_eval_task(recipe)
    recipe, mesh = resolved_mesh(recipe, console=console, evaluating=True)
    trainable = build_trainable(recipe, mesh)
    params, origin = load_weights(recipe, trainable, run_dir, step, console)
    return Evaluator(recipe, mesh, trainable.graphdef)(params, origin, console)


def summary(totals: dict[str, np.ndarray], edges: np.ndarray, recipe: Recipe,
            origin: str) -> dict:
    tokens = totals["tokens"]
    count = max(float(tokens.sum()), 1.0)
    loss = float(totals["loss"].sum()) / count
    per_token = np.maximum(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(loss),
            "accuracy": float(totals["correct"].sum()) / count, "tokens": int(tokens.sum()),
            "batches": recipe.eval.batches, "seq_len": recipe.data.seq_len, "weights": origin,
            "vocab": recipe.model.vocab,
            "by_position": {"edges": edges.tolist(),
                            "loss": (totals["loss"] / per_token).tolist(),
                            "accuracy": (totals["correct"] / per_token).tolist(),
                            "tokens": tokens.astype(int).tolist()}}


def compile_eval_step(recipe: Recipe, devices) -> jax.stages.Compiled:
    """The compiled evaluation step of `lctrain eval` (forward only, loss and accuracy by
    position at eval.seq_len) on `devices` (a TPU topology's, parallel/aot.py), lowered with
    abstract parameters and batch."""
    recipe, mesh = resolved_mesh(recipe, devices)
    recipe = recipe.for_evaluation()
    trainable = build_trainable(recipe, mesh)
    bucket_sums = jax.jit(make_bucket_sums(recipe, trainable.graphdef,
                                           make_strategy(recipe, mesh),
                                           position_edges(recipe.data.seq_len)))
    return bucket_sums.lower(trainable.abstract_state.params,
                             abstract_batch(recipe, mesh)).compile()
