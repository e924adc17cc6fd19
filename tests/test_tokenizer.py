"""Real tokenizers: `lctrain tokenize`, its sidecar, and training data read through them.

A small BPE tokenizer is trained here (vocab about 300, <s> = 0 and </s> = 1, a
post-processor that puts <s> in front), so every expected token file is the tokenizer's own
encode(doc).ids + [eos] per document, in corpus order.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import RecipeError, load_recipe
from lctrain.recipes.schema import DataConfig
from lctrain.trainer.data.checks import check_data
from lctrain.trainer.data.corpus import plan_pieces, tokenize_corpus
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.data.tokenizer import DocumentTokenizer, dtype_for_vocab, write_sidecar
from lctrain.trainer.outputs.failures import DataError

BOS, EOS = 0, 1  # the trainer gives the special tokens the first ids, in order
DOCS = ["The quick brown fox jumps over the lazy dog.",
        "Long context: every chunk attends to every earlier one.",
        "é and ✓ are bytes too",
        "short"]


def train_tokenizer(*, post: str = "<s> $A") -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCS * 20, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=post, special_tokens=[("<s>", BOS), ("</s>", EOS)])
    return tokenizer


def save_tokenizer(folder, tokenizer: Tokenizer, config: dict | None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"), train_tokenizer(),
                          {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture(scope="module")
def reference(hf_dir):
    return Tokenizer.from_file(f"{hf_dir}/tokenizer.json")


def expected_tokens(reference: Tokenizer, docs) -> list[int]:
    return [t for doc in docs for t in [*reference.encode(doc).ids, EOS]]


def write_txt_folder(folder, docs):
    (folder / "sub").mkdir(parents=True)
    # sorted order: 0.txt, 1.txt, ..., with the last in a subfolder (found recursively)
    for index, doc in enumerate(docs):
        target = folder / "sub" if index == len(docs) - 1 else folder
        (target / f"{index}.txt").write_text(doc)
    (folder / "empty.txt").write_text("")  # no document
    (folder / "notes.md").write_text("not a corpus suffix")
    return folder


def write_jsonl(path, docs, field="body"):
    lines = [json.dumps({field: doc, "id": i}) for i, doc in enumerate(docs)]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # a blank line is skipped
    return path


def write_parquet(path, docs):
    pq.write_table(pa.table({"text": docs + [None, ""]}), path, row_group_size=2)
    return path


def tokenize(*args):
    return CliRunner().invoke(app, ["tokenize", *map(str, args)])


def read_bin(path, dtype="uint16"):
    return np.fromfile(path, dtype=dtype).tolist()


# --------------------------------------------------------------------------------------
# lctrain tokenize
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_token_file_is_each_documents_encoding_then_eos(fmt, hf_dir, reference, tmp_path):
    source, extra = {
        "txt": (lambda: write_txt_folder(tmp_path / "corpus", DOCS), []),
        "jsonl": (lambda: write_jsonl(tmp_path / "c.jsonl", DOCS), ["--field", "body"]),
        "parquet": (lambda: write_parquet(tmp_path / "c.parquet", DOCS), []),
    }[fmt]
    out = tmp_path / "tokens.bin"
    result = tokenize(source(), "--tokenizer", hf_dir, "--out", out, "--workers", 1, *extra)
    assert result.exit_code == 0, result.output
    expected = expected_tokens(reference, DOCS)
    assert expected[0] == BOS and expected.count(EOS) == len(DOCS)
    assert read_bin(out) == expected
    assert out.stat().st_size == 2 * len(expected)  # uint16


def test_sidecar_says_how_the_file_was_made(hf_dir, reference, tmp_path):
    out = tmp_path / "tokens.bin"
    result = tokenize(write_txt_folder(tmp_path / "corpus", DOCS), "--tokenizer", hf_dir,
                      "--out", out, "--workers", 1)
    assert result.exit_code == 0, result.output
    sidecar = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert sidecar == {"tokenizer": hf_dir,
                       "tokenizer_fingerprint": DocumentTokenizer.load(hf_dir).fingerprint,
                       "eos_id": EOS, "bos_id": BOS,
                       "vocab_size": reference.get_vocab_size(with_added_tokens=True),
                       "dtype": "uint16", "documents": 4,
                       "tokens": len(expected_tokens(reference, DOCS))}
    assert 200 < sidecar["vocab_size"] <= 300


def test_workers_write_the_same_bytes_in_corpus_order(hf_dir, reference, tmp_path):
    docs = [f"document {i}: " + DOCS[i % len(DOCS)] * (1 + i % 3) for i in range(40)]
    corpus = write_jsonl(tmp_path / "c.jsonl", docs, field="text")
    tokenizer = DocumentTokenizer.load(hf_dir)
    pieces = plan_pieces([str(corpus)], "text", chunk_bytes=300)  # cut into many pieces
    assert len(pieces) >= 8
    assert pieces[0].start == 0 and pieces[-1].stop == corpus.stat().st_size
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}.bin"
        info = tokenize_corpus(pieces, tokenizer, out, workers=workers)
        assert info["documents"] == 40
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    assert np.frombuffer(outputs[0], np.uint16).tolist() == expected_tokens(reference, docs)


def test_cli_with_two_workers_matches_one(hf_dir, tmp_path):
    corpus = write_txt_folder(tmp_path / "corpus", DOCS)
    for workers in (1, 2):
        result = tokenize(corpus, "--tokenizer", hf_dir, "--out", tmp_path / f"{workers}.bin",
                          "--workers", workers)
        assert result.exit_code == 0, result.output
    assert (tmp_path / "1.bin").read_bytes() == (tmp_path / "2.bin").read_bytes()


def test_dtype_is_uint16_up_to_65536_ids():
    assert dtype_for_vocab(300) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"   # ids 0..65535
    assert dtype_for_vocab(65537) == "uint32"
    assert dtype_for_vocab(128256) == "uint32"  # Llama 3


def test_bos_and_eos_follow_the_tokenizer_config(tmp_path):
    # No post-processor adds <s> here, so add_bos_token must; the post-processor already
    # ends each encoding with </s>, which must not be doubled. eos_token as a saved
    # AddedToken (a dict with "content") is read too.
    folder = save_tokenizer(tmp_path / "tok", train_tokenizer(post="$A </s>"),
                            {"bos_token": {"content": "<s>"}, "eos_token": {"content": "</s>"},
                             "add_bos_token": True})
    tokenizer = DocumentTokenizer.load(folder)
    plain = Tokenizer.from_file(f"{folder}/tokenizer.json").encode("short").ids
    assert plain[-1] == EOS and plain[0] != BOS
    assert tokenizer.encode_documents(["short"]) == [[BOS, *plain]]


# --------------------------------------------------------------------------------------
# Training data read through a tokenizer
# --------------------------------------------------------------------------------------

def test_training_takes_eos_from_the_sidecar(hf_dir, reference, tmp_path):
    out = tmp_path / "tokens.bin"
    tokenize(write_txt_folder(tmp_path / "corpus", DOCS[:2]), "--tokenizer", hf_dir,
             "--out", out, "--workers", 1)
    stream = expected_tokens(reference, DOCS[:2])
    first = len(reference.encode(DOCS[0]).ids) + 1  # the first document, its eos included
    cfg = DataConfig(seq_len=len(stream) - 1, batch_size=1, source=str(out))
    assert cfg.eos_id is None and cfg.token_dtype is None
    batch = make_source(cfg, vocab=300, seed=0).batch(0)
    assert batch.inputs[0].tolist() == stream[:-1]
    assert batch.segment_ids[0].tolist() == [1] * first + [2] * (len(stream) - 1 - first)
    assert batch.positions[0, first] == 0 and batch.loss_mask[0, first - 1] == 0

    (tmp_path / "tokens.bin.json").unlink()  # without it: one endless document
    batch = make_source(cfg, vocab=300, seed=0).batch(0)
    assert set(batch.segment_ids[0].tolist()) == {1}


def test_training_takes_the_dtype_from_the_sidecar(tmp_path):
    path = tmp_path / "wide.bin"
    np.array([70000, 5, 1, 70001, 6], np.uint32).tofile(path)
    write_sidecar(path, dict(tokenizer="t", eos_id=1, bos_id=None, vocab_size=70002,
                             dtype="uint32", documents=2, tokens=5))
    batch = make_source(DataConfig(seq_len=4, source=str(path)), vocab=70002, seed=0).batch(0)
    assert batch.inputs[0].tolist() == [70000, 5, 1, 70001]  # read as uint16 it would be 10
    assert batch.segment_ids[0].tolist() == [1, 1, 1, 2]


def test_text_source_with_data_tokenizer(hf_dir, reference, tmp_path):
    corpus = write_txt_folder(tmp_path / "corpus", DOCS[:2])
    stream = expected_tokens(reference, DOCS[:2])
    cfg = DataConfig(seq_len=len(stream) - 1, source=str(corpus), tokenizer=hf_dir)
    batch = make_source(cfg, vocab=300, seed=0).batch(0)
    assert batch.inputs[0].tolist() == stream[:-1]
    assert batch.segment_ids[0].max() == 2


# --------------------------------------------------------------------------------------
# Errors before anything compiles
# --------------------------------------------------------------------------------------

@pytest.fixture
def token_file(hf_dir, tmp_path):
    out = tmp_path / "tokens.bin"
    result = tokenize(write_txt_folder(tmp_path / "corpus", DOCS), "--tokenizer", hf_dir,
                      "--out", out, "--workers", 1)
    assert result.exit_code == 0, result.output
    return out


def test_tokenizer_larger_than_model_vocab_stops_the_recipe(hf_dir, reference, token_file):
    vocab = reference.get_vocab_size(with_added_tokens=True)
    # The tiny preset has model.vocab 128.
    with pytest.raises(RecipeError, match=f"tokenizer vocabulary {vocab} exceeds model.vocab "
                                          f"128"):
        check_data(load_recipe("tiny", [f"data.source={token_file}"]))
    with pytest.raises(RecipeError, match=f"data.tokenizer .*: tokenizer vocabulary {vocab} "
                                          f"exceeds model.vocab 128"):
        check_data(load_recipe("tiny", [f"data.source={token_file.parent / 'corpus'}",
                           f"data.tokenizer={hf_dir}"]))
    recipe = check_data(load_recipe("tiny", [f"data.source={token_file}",
                                             f"model.vocab={vocab}"]))
    assert recipe.data.eos_id is None  # left to the sidecar, read again by make_source


@pytest.mark.parametrize("key, value, sidecar_value", [
    ("eos_id", 5, EOS),
    ("token_dtype", "uint32", "uint16"),
])
def test_recipe_value_that_disagrees_with_the_sidecar(token_file, key, value, sidecar_value):
    # Both values are named: the recipe's, then the sidecar's in parentheses.
    words = (f"'data.{key}' = {value!r} disagrees with sidecar {token_file}.json "
             f"({sidecar_value!r})")
    with pytest.raises(RecipeError) as err:
        check_data(load_recipe("tiny", [f"data.source={token_file}", "model.vocab=512",
                                        f"data.{key}={value}"]))
    assert words in str(err.value)
    with pytest.raises(DataError) as err:
        make_source(DataConfig(seq_len=4, source=str(token_file), **{key: value}),
                    vocab=512, seed=0)
    assert words in str(err.value)


def test_data_tokenizer_needs_a_text_source(hf_dir, token_file):
    with pytest.raises(RecipeError, match="'data.tokenizer' = .*only used with a text"):
        check_data(load_recipe("tiny", [f"data.source={token_file}", "model.vocab=512",
                                        f"data.tokenizer={hf_dir}"]))


@pytest.mark.parametrize("case, words", [
    ("missing source", "nope.txt: no such file or folder"),
    ("unknown suffix", "c.csv: unknown suffix '.csv'"),
    ("missing column", "no column 'body' (columns: text)"),
    ("no tokenizer", "--tokenizer"),
    ("no eos_token", "no eos_token"),
])
def test_cli_bad_input_is_one_line_and_exit_2(case, words, hf_dir, tmp_path):
    corpus = write_txt_folder(tmp_path / "corpus", DOCS)
    (tmp_path / "c.csv").write_text("a,b")
    no_eos = save_tokenizer(tmp_path / "tok", train_tokenizer(), {"bos_token": "<s>"})
    args = {
        "missing source": [corpus, tmp_path / "nope.txt", "--tokenizer", hf_dir],
        "unknown suffix": [tmp_path / "c.csv", "--tokenizer", hf_dir],
        "missing column": [write_parquet(tmp_path / "c.parquet", DOCS), "--field", "body",
                           "--tokenizer", hf_dir],
        "no tokenizer": [corpus, "--tokenizer", tmp_path / "no-such-model"],
        "no eos_token": [corpus, "--tokenizer", no_eos],
    }[case]
    result = tokenize(*args, "--out", tmp_path / "t.bin")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.output
    assert not (tmp_path / "t.bin").exists()


def test_cli_jsonl_line_without_the_field(hf_dir, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS, field="body")
    result = tokenize(corpus, "--tokenizer", hf_dir, "--out", tmp_path / "t.bin")
    assert result.exit_code == 2, result.output
    assert "c.jsonl line 1: no field 'text'; pick the text field with --field" in result.output
    assert not (tmp_path / "t.bin").exists() and not list(tmp_path.glob(".t.bin*"))


# --------------------------------------------------------------------------------------
# Nothing a user has is overwritten or misread
# --------------------------------------------------------------------------------------

def test_tokenize_refuses_an_existing_out_unless_overwrite(hf_dir, token_file, tmp_path):
    before = token_file.read_bytes(), (tmp_path / "tokens.bin.json").read_text()
    corpus = write_jsonl(tmp_path / "other.jsonl", DOCS[:2], field="text")
    result = tokenize(corpus, "--tokenizer", hf_dir, "--out", token_file)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"--out {token_file}: the file exists already" in lines[0] and "--overwrite" in lines[0]
    assert (token_file.read_bytes(), (tmp_path / "tokens.bin.json").read_text()) == before
    result = tokenize(corpus, "--tokenizer", hf_dir, "--out", token_file, "--overwrite")
    assert result.exit_code == 0, result.output
    sidecar = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert sidecar["documents"] == 2 and token_file.stat().st_size == 2 * sidecar["tokens"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_overwrite_never_replaces_a_folder_with_the_token_file(hf_dir, tmp_path):
    folder = tmp_path / "data.bin"  # a folder that happens to have the name
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    result = tokenize(write_jsonl(tmp_path / "c.jsonl", DOCS[:1], field="text"),
                      "--tokenizer", hf_dir, "--out", folder, "--overwrite")
    assert result.exit_code == 2, result.output
    assert f"--out {folder}: is a folder, and the command writes a file" in result.output
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_failed_tokenize_leaves_the_old_files(hf_dir, token_file, tmp_path):
    before = token_file.read_bytes(), (tmp_path / "tokens.bin.json").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    result = tokenize(bad, "--tokenizer", hf_dir, "--out", token_file, "--overwrite")
    assert result.exit_code == 2 and "bad.jsonl line 2: not valid JSON" in result.output
    assert (token_file.read_bytes(), (tmp_path / "tokens.bin.json").read_text()) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_fingerprint_tells_tokenizers_of_one_vocabulary_size_apart(hf_dir, tmp_path):
    copy = save_tokenizer(tmp_path / "copy", train_tokenizer(),
                          {"bos_token": "<s>", "eos_token": "</s>"})
    # The same vocabulary with two tokens' ids swapped: same size, other ids.
    spec = json.loads(train_tokenizer().to_str())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    other = Tokenizer.from_str(json.dumps(spec))
    other_dir = save_tokenizer(tmp_path / "other", other, {"bos_token": "<s>", "eos_token": "</s>"})
    ours = DocumentTokenizer.load(hf_dir)
    assert DocumentTokenizer.load(copy).fingerprint == ours.fingerprint
    assert DocumentTokenizer.load(other_dir).vocab_size == ours.vocab_size
    assert DocumentTokenizer.load(other_dir).fingerprint != ours.fingerprint


def test_a_token_file_replaced_without_its_sidecar_is_refused(token_file):
    token_file.write_bytes(token_file.read_bytes()[:-4])
    with pytest.raises(RecipeError) as err:
        check_data(load_recipe("tiny", [f"data.source={token_file}", "model.vocab=512"]))
    assert f"data.source {token_file}: " in str(err.value)
    assert "come from different runs of lctrain tokenize" in str(err.value)
