"""`lctrain eval`: the loss it prints is transformers' loss on the same batches."""

import functools
import io
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import load_recipe
from lctrain.trainer.data.sources import make_source

from make_hf_model import make_hf_model


def test_eval_loss_equals_transformers_on_the_same_batches(tmp_path):
    model = make_hf_model(tmp_path / "model")
    tokens = np.random.default_rng(0).integers(0, 256, 4000).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)  # no eos: one document, plain windows
    sets = [f"model.init=hf:{tmp_path / 'model'}", "model.dtype=float32",
            f"data.source={tmp_path / 'tokens.npy'}", "data.seq_len=64", "data.batch_size=8",
            "eval.batches=3", "parallel.strategy=ring", "mesh.data=2", "mesh.context=4",
            "attention.block_kv=16"]
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path / "none"), "--json",
                                      "--out", str(tmp_path / "out"),
                                      *[arg for s in sets for arg in ("--set", s)]])
    assert result.exit_code == 0, result.output
    ours = json.loads(result.output.strip().splitlines()[-1])

    recipe = load_recipe("tiny", sets)
    source = make_source(recipe.data, vocab=256, seed=recipe.train.seed, split="eval")
    losses = []
    for index in range(3):
        batch = source.batch(index)
        window = np.concatenate([batch.inputs, batch.targets[:, -1:]], axis=1)
        ids = torch.tensor(window, dtype=torch.long)
        with torch.no_grad():
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    assert ours["tokens"] == 3 * 8 * 64
    assert ours["loss"] == pytest.approx(np.mean(losses), rel=1e-4)
    assert ours["perplexity"] == pytest.approx(np.exp(ours["loss"]))


def test_eval_without_weights_says_where_to_get_them(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "no weights" in result.output and "model.init=hf:<dir>" in result.output


def test_position_edges_are_log_spaced_up_to_the_length():
    from lctrain.trainer.evaluation.evaluate import position_edges

    assert position_edges(256).tolist() == [0, 1, 2, 3, 4, 6, 9, 13, 19, 28, 40, 58, 84, 122,
                                            177, 256]
    assert position_edges(8).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]


# Per-token cross-entropy and argmax computed densely here, bucketed by hand, against the
# device-side bucket sums, on one device and under every strategy (8 devices, loss in
# chunks, packed documents).
EVAL_CASES = [("none", {"data": 1}), ("all_gather", {"data": 1, "context": 8}),
              ("ulysses", {"data": 2, "context": 4}), ("ring", {"data": 1, "context": 8}),
              ("usp", {"data": 1, "context": 8, "ulysses": 2})]


EVAL_SETS = ["data.seq_len=64", "data.batch_size=4", "model.n_heads=8", "model.n_kv_heads=2",
             "model.d_model=64", "attention.block_kv=8", "loss.chunk_tokens=16"]


@functools.cache
def hand_computed_bucket_sums():
    """(params, each bucket's loss, correct and token sums) of the model every case builds
    (the same recipe keys, Rngs(3)), computed once: dense logits, bucketed by hand."""
    import jax
    from flax import nnx

    from lctrain.trainer.evaluation.evaluate import position_edges
    from lctrain.trainer.model.transformer import Transformer

    from test_model import model_logits
    from helpers import fast_jit
    from test_strategies import mixed_batch

    recipe = load_recipe("tiny", EVAL_SETS)
    graphdef, state = nnx.split(Transformer(recipe.model, nnx.Rngs(3)))
    params = nnx.to_pure_dict(state)
    fixed = mixed_batch(recipe.model.vocab, 64)
    fields = (fixed.inputs, fixed.positions, fixed.segment_ids)
    logits = fast_jit(lambda p, *x: model_logits(p, graphdef, *x), params, *fields)
    logits = np.asarray(logits(params, *fields), np.float64)
    peak = logits.max(-1, keepdims=True)
    log_partition = (np.log(np.exp(logits - peak).sum(-1, keepdims=True)) + peak)[..., 0]
    target_logit = np.take_along_axis(logits, fixed.targets[..., None], -1)[..., 0]
    losses, correct = log_partition - target_logit, logits.argmax(-1) == fixed.targets
    edges = position_edges(64)
    bucket = np.searchsorted(edges, fixed.positions, side="right") - 1
    counted = fixed.loss_mask > 0
    return params, {name: np.bincount(bucket[counted], values[counted], minlength=len(edges) - 1)
                    for name, values in [("loss", losses), ("correct", correct),
                                         ("tokens", np.ones_like(losses))]}


@pytest.mark.parametrize("strategy, mesh", EVAL_CASES)
def test_bucket_sums_equal_a_hand_computation(strategy, mesh):
    import jax
    from flax import nnx
    from types import SimpleNamespace

    from lctrain.parallel import make_strategy
    from lctrain.trainer.data.batches import Batch
    from lctrain.trainer.evaluation.evaluate import make_bucket_sums, position_edges
    from lctrain.trainer.state.build import device_batch, mesh_for
    from lctrain.trainer.model.transformer import Transformer
    from lctrain.trainer.state.step import BATCH_FIELDS

    from helpers import fast_jit
    from test_strategies import mixed_batch

    mesh = dict(mesh)
    ulysses = mesh.pop("ulysses", 1)
    sets = [f"parallel.strategy={strategy}", *EVAL_SETS, f"parallel.ulysses={ulysses}",
            *[f"mesh.{axis}={size}" for axis, size in mesh.items()]]
    recipe = load_recipe("tiny", sets)
    devices = jax.devices()[:1] if strategy == "none" else jax.devices()
    device_mesh = mesh_for(recipe, devices)
    graphdef = nnx.graphdef(Transformer(recipe.model, nnx.Rngs(3)))
    params, expected = hand_computed_bucket_sums()
    fixed = mixed_batch(recipe.model.vocab, 64)
    source = SimpleNamespace(cfg=recipe.data, batch=lambda index, rows: Batch(
        *(getattr(fixed, name)[rows] for name in BATCH_FIELDS)))
    strategy_object = make_strategy(recipe, device_mesh)
    batch = device_batch(source, 0, strategy_object.sequence_order(64), device_mesh)
    bucket_sums = make_bucket_sums(recipe, graphdef, strategy_object, position_edges(64))
    sums = fast_jit(bucket_sums, params, batch)(params, batch)
    for name, values in expected.items():
        np.testing.assert_allclose(np.asarray(sums[name]), values, rtol=1e-5, atol=1e-4,
                                   err_msg=name)


def test_eval_seq_len_the_mesh_cannot_split_is_named(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path), "--set",
                                      "parallel.strategy=ring", "--set", "mesh.context=8",
                                      "--set", "eval.seq_len=1000"])
    assert result.exit_code == 2
    assert "'eval.seq_len' = 1000: must be divisible by 16" in result.output


def test_missing_eval_source_is_named_at_load(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path), "--set",
                                      f"eval.source={tmp_path / 'held_out.bin'}"])
    assert result.exit_code == 2
    assert f"'eval.source' = '{tmp_path / 'held_out.bin'}': no such file" in result.output


class FakeTpu:
    """What mesh_for reads of a device before it builds the mesh."""
    platform, device_kind, process_index = "tpu", "TPU v5p", 0


@pytest.mark.parametrize("every", [0, 100])
def test_pallas_tiles_are_checked_at_eval_seq_len_when_training_evaluates(every):
    """ring on 4 TPU devices: data.seq_len 8192 tiles (2048-token chunks), eval.seq_len 8000
    (2000-token chunks) does not; `lctrain eval` and a run with eval.every must refuse it
    before compiling, a run that never evaluates need not."""
    from lctrain.recipes import RecipeError
    from lctrain.trainer.state.build import mesh_for

    recipe = load_recipe("tiny", ["parallel.strategy=ring", "mesh.context=4", "mesh.data=1",
                                "data.batch_size=1", "data.seq_len=8192", "eval.seq_len=8000",
                                "attention.impl=pallas", "parallel.load_balance=false",
                                f"eval.every={every}", "eval.holdout=0.0"])
    tpus = [FakeTpu()] * 4
    refusal = r"2000 queries x 2000 keys \(eval.seq_len 8000, .* make eval.seq_len a multiple"
    with pytest.raises(RecipeError, match=refusal):
        mesh_for(recipe, tpus, evaluating=True)
    if every:
        with pytest.raises(RecipeError, match=refusal):
            mesh_for(recipe, tpus)
    else:
        with pytest.raises(Exception) as built:   # the check passes; building needs real TPUs
            mesh_for(recipe, tpus)
        assert not isinstance(built.value, RecipeError)


def test_evaluation_during_training_is_held_out_and_resumes_without_repeats(tmp_path):
    """A token file with every 4th window held out: eval every 2 steps; a run to 4 steps
    resumed to 6 evaluates at 2, 4 and 6 once each, and the evaluation at 6 equals
    `lctrain eval` of the final checkpoint (same held-out batches, same weights)."""
    from lctrain.trainer.evaluation.evaluate import evaluate
    from lctrain.trainer.train.loop import train

    np.save(tmp_path / "tokens.npy",
            np.random.default_rng(1).integers(0, 128, 64 * 40 + 1).astype(np.int32))
    sets = [f"data.source={tmp_path / 'tokens.npy'}", "data.seq_len=64", "data.batch_size=8",
            "eval.every=2", "eval.holdout=0.25", "eval.batches=2", "train.warmup_steps=1",
            "runtime.log_every=1", "checkpoint.every=2"]
    run_dir = tmp_path / "run"
    train(load_recipe("tiny", [*sets, "train.steps=4"]), run_dir)
    train(load_recipe("tiny", [*sets, "train.steps=6"]), run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evaluations] == [2, 4, 6]
    assert evaluations[-1]["eval/tokens"] == 2 * 8 * 64
    final = evaluate(load_recipe("tiny", [*sets, "train.steps=6"]), run_dir)
    assert final["weights"].endswith("step 6")
    assert evaluations[-1]["eval/loss"] == pytest.approx(final["loss"], rel=1e-6)


def test_held_out_windows_never_reach_training(tmp_path):
    np.save(tmp_path / "tokens.npy", np.arange(16 * 20 + 1, dtype=np.int32) % 100)
    recipe = load_recipe("tiny", [f"data.source={tmp_path / 'tokens.npy'}", "data.seq_len=16",
                                "data.batch_size=4", "eval.holdout=0.2"])
    first_token = lambda source, batches: {int(row[0]) for index in range(batches)
                                           for row in source.batch(index).inputs}
    train = make_source(recipe.data, vocab=128, seed=0, holdout=0.2)
    held_out = make_source(recipe.data, vocab=128, seed=0, split="eval", holdout=0.2)
    # 20 windows: 0, 5, 10, 15 held out (their first tokens 0, 80, 160 % 100, 240 % 100).
    assert first_token(held_out, 1) == {0, 80, 60, 40}
    seen = first_token(train, 8)  # two epochs of the 16 training windows
    assert len(seen) == 16 and not seen & {0, 80, 60, 40}


# --------------------------------------------------------------------------- pictures ----

def flat_result(trained=256, seq_len=1024):
    """What `lctrain eval` returns for a random model: loss flat near log(vocab)."""
    edges = [0, 1, 2, 4, 16, 64, 256, 1024][:8]
    return {"weights": "checkpoint step 3 of runs/tiny", "seq_len": seq_len, "vocab": 128,
            "trained_seq_len": trained, "loss": 4.86, "perplexity": 129.0, "accuracy": 0.01,
            "tokens": 100, "by_position": {"edges": edges, "tokens": [1] * 7,
                                           "loss": [4.86, 4.85, 4.87, 4.86, 4.85, 4.86, 4.86],
                                           "accuracy": [0.01] * 7}}


def test_by_position_plot_marks_log_vocab_and_the_trained_length():
    import math

    from lctrain.cli.eval_report import by_position_figure

    figure = by_position_figure(flat_result())
    loss_axis, accuracy_axis = figure.axes
    horizontal = [line.get_ydata()[0] for line in loss_axis.lines if line.get_linestyle() == ":"]
    assert horizontal == [pytest.approx(math.log(128))]
    # The flat curve keeps its place: the range starts at 0 and reaches log(vocab).
    bottom, top = loss_axis.get_ylim()
    assert bottom == 0 and top >= math.log(128)
    for axis in (loss_axis, accuracy_axis):
        assert [line.get_xdata()[0] for line in axis.lines if line.get_linestyle() == "--"] == [256]
    assert "trained length 256" in [text.get_text() for text in loss_axis.get_legend().texts]


def test_heatmap_names_the_weights_and_samples_and_writes_each_cell():
    from lctrain.cli.eval_report import heatmap_figure

    retrieval = {"task": "passkey", "lengths": [128, 256, 512], "depths": [0.0, 0.5, 1.0],
                 "accuracy": [[1.0, 0.5, 0.0], [1.0, 1.0, 0.25], [0.0, 0.0, 0.0]],
                 "mean": 0.42, "samples_per_cell": 1}
    figure = heatmap_figure(retrieval, "checkpoint step 300 of runs/long")
    axis = figure.axes[0]
    assert "checkpoint step 300 of runs/long; 1 sample per cell" in axis.get_title()
    cells = sorted(text.get_text() for text in axis.texts)
    assert cells == sorted(f"{value:.2f}" for row in retrieval["accuracy"] for value in row)


def test_retrieval_table_counts_samples_in_good_grammar():
    from rich.console import Console

    from lctrain.cli.eval_report import render_table

    result = {**flat_result(), "retrieval": {
        "task": "passkey", "lengths": [128], "depths": [0.5], "accuracy": [[1.0]],
        "mean": 1.0, "samples_per_cell": 1}}
    out = io.StringIO()
    render_table(result, Console(file=out, width=300))
    assert "share of the 1 sample per cell" in " ".join(out.getvalue().split())
    assert "1 samples" not in out.getvalue()


def retrieval_grid(lengths: list[int], depths: list[float]) -> dict:
    """A retrieval result whose every cell differs (eval.json's order: by length, then
    depth)."""
    accuracy = [[round((7 * i + 3 * j) % 10 / 10 + 0.01 * j, 2) for j in range(len(depths))]
                for i in range(len(lengths))]
    return {"task": "passkey", "lengths": lengths, "depths": depths, "accuracy": accuracy,
            "mean": 0.5, "samples_per_cell": 4}


def rendered_retrieval(retrieval: dict, width: int) -> str:
    from rich.console import Console

    from lctrain.cli.eval_report import render_table

    out = io.StringIO()
    render_table({**flat_result(), "retrieval": retrieval}, Console(file=out, width=width))
    return out.getvalue()


def table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the tables after the first (the loss table)."""
    tables = text.split("┏")[2:]
    return [[cell.strip() for cell in line.strip("│").split("│")]
            for table in tables for line in table.splitlines() if line.startswith("│")]


def test_retrieval_table_and_heatmap_share_their_axes():
    """The heatmap has depth down and length across; the table had length down and depth
    across. Both now put one needle depth on each row and one haystack length in each
    column, and hold the same value in the same place."""
    from lctrain.cli.eval_report import heatmap_figure

    retrieval = retrieval_grid([128, 256, 512], [0.0, 0.5])
    image = heatmap_figure(retrieval, "runs/long").axes[0]
    assert image.get_ylabel() == "needle depth" and image.get_xlabel().startswith("haystack length")
    grid = image.images[0].get_array()
    assert grid.shape == (2, 3)  # depths x lengths
    rows = table_rows(rendered_retrieval(retrieval, 200))
    assert [row[0] for row in rows] == ["0", "50"]
    assert [[float(cell) for cell in row[1:]] for row in rows] == grid.tolist()
    assert "by needle depth (rows, %) and haystack length (columns, tokens)" in " ".join(
        rendered_retrieval(retrieval, 200).split())


@pytest.mark.parametrize("width", [80, 100])
def test_retrieval_table_is_whole_in_a_narrow_terminal(width):
    """Eleven lengths up to 1M tokens by eleven depths read '0.…' at 80 and 100 columns;
    now the lengths are stacked in tables that fit, every value whole and in its place."""
    retrieval = retrieval_grid([2 ** k for k in range(10, 21)], [i / 10 for i in range(11)])
    text = rendered_retrieval(retrieval, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines() if line[:1] in "┏┃┡│└") <= width
    headers = [line for line in text.splitlines() if line.startswith("┃")]
    assert all(f"{length:,}" in " ".join(headers) for length in retrieval["lengths"])
    by_depth: dict[str, list[str]] = {}
    for row in table_rows(text):
        by_depth.setdefault(row[0], []).extend(row[1:])
    assert list(by_depth) == [f"{depth * 100:.0f}" for depth in retrieval["depths"]]
    for j, cells in enumerate(by_depth.values()):
        assert cells == [f"{row[j]:.2f}" for row in retrieval["accuracy"]]
