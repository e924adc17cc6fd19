"""Export to Hugging Face: transformers loads what lctrain writes and gives lctrain's loss;
and the whole context-extension workflow from an HF folder to an HF folder, on CPU."""

import json

import jax
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import load_run_recipe
from lctrain.trainer.hf.export import export_hf
from lctrain.trainer.hf.safetensors_io import INDEX_FILE, SafetensorsFolder
from lctrain.trainer.hf.weights import load_weights
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import build_trainable

from make_hf_model import make_hf_model
from test_hf import LLAMA3, hf_logits_and_loss, loaded, our_loss, recipe_for, tokens

RELATIVE = 1e-4


def test_import_then_export_gives_back_the_same_tensors(tmp_path):
    source, out = tmp_path / "source", tmp_path / "out"
    make_hf_model(source, family="qwen2", rope_scaling=LLAMA3)
    recipe = recipe_for(source)
    _, _, params = loaded(recipe, jax.devices()[:1])
    # Tiny shards: the index and several files are written, and read back alike.
    export_hf(recipe, params, out, "float32", max_shard_bytes=40_000)
    assert (out / INDEX_FILE).is_file() and len(list(out.glob("*.safetensors"))) > 2
    original, exported = SafetensorsFolder(source), SafetensorsFolder(out)
    assert set(exported.entries) == set(original.entries)
    for name in original.entries:
        np.testing.assert_array_equal(exported.read(name), original.read(name), err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["model_type"] == "qwen2"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_loads_the_export_with_our_loss(tmp_path, dtype):
    source, out = tmp_path / "source", tmp_path / "out"
    make_hf_model(source, tie=True, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                      original_max_position_embeddings=32))
    recipe = recipe_for(source)
    _, _, params = loaded(recipe, jax.devices()[:1])
    export_hf(recipe, params, out, dtype)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters["rope_type"] == "yarn"
    ids = tokens(2)
    _, hf_loss = hf_logits_and_loss(reloaded, ids)
    # Both read the exported file (rounded to bf16 or not); a float32 export also keeps
    # the loss of the weights it came from.
    assert our_loss(recipe_for(out), ids, jax.devices()[:1]) == pytest.approx(hf_loss,
                                                                              rel=RELATIVE)
    if dtype == "float32":
        assert hf_loss == pytest.approx(our_loss(recipe, ids, jax.devices()[:1]), rel=RELATIVE)


def small_tokenizer(folder, texts):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>"}))
    return tokenizer


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_context_extension_workflow(tmp_path):
    """A CPU-sized copy of docs/extension.md "Extend a pretrained model's context": an HF model made
    for 32 positions, tokenized text, 3 steps at 128 tokens with yarn on ring (context 4),
    export (the token file deleted by then: only its sidecar names the tokenizer), and
    transformers reloads it with lctrain's loss."""
    rng = np.random.default_rng(0)
    words = ["long", "context", "ring", "token", "model", "chip", "train", "data"]
    texts = [" ".join(rng.choice(words, size=rng.integers(20, 80))) for _ in range(40)]
    tokenizer = small_tokenizer(tmp_path / "model", texts)
    make_hf_model(tmp_path / "model", vocab=tokenizer.get_vocab_size(), max_positions=32)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": text}) for text in texts))
    cli("tokenize", corpus, "--tokenizer", tmp_path / "model", "--out", tmp_path / "tokens.bin")
    run_dir = tmp_path / "run"
    cli("run", "--run-dir", run_dir, "--steps", 3,
        "--set", f"model.init=hf:{tmp_path / 'model'}", "--set", "model.dtype=float32",
        "--set", "model.rope_scaling={type: yarn, factor: 4}",
        "--set", f"data.source={tmp_path / 'tokens.bin'}", "--set", "data.seq_len=128",
        "--set", "data.batch_size=2", "--set", "mesh.data=2", "--set", "mesh.context=4",
        "--set", "parallel.strategy=ring", "--set", "train.warmup_steps=1",
        "--set", "train.lr=1e-3", "--set", "attention.block_kv=16")
    (tmp_path / "tokens.bin").unlink()  # export needs the weights, not the training data
    cli("export", run_dir, tmp_path / "export", "--dtype", "float32")

    assert (tmp_path / "export" / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                    dtype=torch.float32).eval()
    assert reloaded.config.max_position_embeddings == 128
    assert reloaded.config.rope_parameters["rope_type"] == "yarn"
    ids = np.asarray([tokenizer.encode(" ".join(texts[:6])).ids[:129]] * 2, np.int32)
    _, hf_loss = hf_logits_and_loss(reloaded, ids)
    recipe = load_run_recipe(run_dir)
    mesh = mesh_for(recipe)
    params, origin = load_weights(recipe, build_trainable(recipe, mesh), run_dir)
    assert origin.endswith("step 3")
    assert our_loss(recipe, ids, jax.devices(), params=params) == pytest.approx(
        hf_loss, rel=RELATIVE)
