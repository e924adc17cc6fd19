"""`lctrain eval`: the loss it prints is transformers' loss on the same batches."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import load_recipe
from lctrain.trainer.data import make_source
from lctrain.trainer.evaluate import EVAL_SEED_OFFSET

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
                                      *[arg for s in sets for arg in ("--set", s)]])
    assert result.exit_code == 0, result.output
    ours = json.loads(result.output.strip().splitlines()[-1])

    recipe = load_recipe(None, sets)
    source = make_source(recipe.data, vocab=256, seed=recipe.train.seed + EVAL_SEED_OFFSET)
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
