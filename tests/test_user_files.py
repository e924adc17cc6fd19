"""Nothing a user has is lost: `lctrain export` and `eval --out` never write into a folder
that holds files without --overwrite, with it replace only their own files, never write
over the run's own model, data or run dir, and a crash mid-export leaves the old folder
whole; training refuses tokens from a tokenizer other than the imported model's, and the
advice it gives for a vocabulary too small works. The run dir keeps the tokenizer it trained
with: export ships that one, and eval refuses tokens of another."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import RecipeError
from lctrain.trainer.data.provenance import shipped_tokenizer
from lctrain.trainer.data.tokenizer import DocumentTokenizer
from lctrain.trainer.hf import export as hf_export
from lctrain.trainer.hf.safetensors_io import SafetensorsFolder

from make_hf_model import make_hf_model
from test_export import small_tokenizer

TEXTS = [" ".join(["long", "context", "ring", "token", "model", "chip"][i % 6:] * 8)
         for i in range(24)]


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    return result.exit_code, lines, result.output


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A model folder with its own tokenizer, its text tokenized, and a run of one step."""
    root = tmp_path_factory.mktemp("user_files")
    tokenizer = small_tokenizer(root / "model", TEXTS)
    make_hf_model(root / "model", vocab=tokenizer.get_vocab_size(), max_positions=64)
    (root / "corpus.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    code, _, output = invoke("tokenize", root / "corpus.jsonl", "--tokenizer", root / "model",
                             "--out", root / "data" / "tokens.bin")
    assert code == 0, output
    code, _, output = invoke(
        "run", "--run-dir", root / "run", "--steps", 1, "--set", f"model.init=hf:{root / 'model'}",
        "--set", f"data.source={root / 'data' / 'tokens.bin'}", "--set", "data.seq_len=32",
        "--set", "data.batch_size=8")
    assert code == 0, output
    return root


@pytest.fixture(scope="module")
def other(run):
    """Another tokenizer of the model's vocabulary size (two ids swapped: only the
    fingerprint tells), and the corpus in its tokens."""
    spec = json.loads((run / "model" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    folder = run / "other"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(run / "model" / "tokenizer_config.json", folder)
    code, _, output = invoke("tokenize", run / "corpus.jsonl", "--tokenizer", folder,
                             "--out", run / "other.bin")
    assert code == 0, output
    return folder


def model_files(folder):
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def test_export_refuses_a_folder_that_holds_files(run, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    code, lines, output = invoke("export", run / "run", tmp_path / "out")
    assert code == 2 and len(lines) == 1, output
    assert f"OUT_DIR {tmp_path / 'out'}: the folder holds files already" in lines[0]
    assert "--overwrite" in lines[0]
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("target, what", [("model", "the run's model.init folder"),
                                          ("run", "the run dir"), (".", "the run dir"),
                                          ("data", "the run's data.source")])
def test_export_never_writes_over_the_runs_own_folders(run, target, what):
    before = model_files(run / "model"), model_files(run / "data")
    code, lines, output = invoke("export", run / "run", run / target, "--overwrite")
    assert code == 2 and len(lines) == 1, output
    assert what in lines[0] and "never overwritten" in lines[0]
    assert (model_files(run / "model"), model_files(run / "data")) == before


def test_export_with_overwrite_replaces_only_an_exports_files(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00002-of-00002.safetensors").write_text("an earlier export's shard")
    (out / "notes.txt").write_text("mine")
    code, lines, output = invoke("export", run / "run", out, "--overwrite")
    assert code == 0, output
    assert "model-00002-of-00002.safetensors" not in {path.name for path in out.iterdir()}
    assert (out / "notes.txt").read_text() == "mine"
    written = sorted(path.name for path in out.iterdir() if path.name != "notes.txt")
    assert f": {', '.join(written)}; tokenizer from the run's tokenizer" in lines[-1]
    assert set(SafetensorsFolder(out).entries) == set(SafetensorsFolder(run / "model").entries)
    assert [path.name for path in tmp_path.iterdir()] == ["out"]  # no staging left


def test_a_crash_mid_export_leaves_the_old_folder(run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(run / "model", out)
    before = model_files(out)
    calls = []

    def dies_on_the_third_tensor(*args, **kwargs):
        produce = args[3]

        def produce_some(name):
            calls.append(name)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")  # halfway through the files
            return produce(name)
        return real_write(*args[:3], produce_some, *args[4:], **kwargs)

    real_write = hf_export.write_folder
    monkeypatch.setattr(hf_export, "write_folder", dies_on_the_third_tensor)
    code, lines, output = invoke("export", run / "run", out, "--overwrite")
    assert code == 1 and "No space left on device" in lines[-1], output
    assert model_files(out) == before
    assert [path.name for path in tmp_path.iterdir()] == ["out"]


def test_tokens_of_another_tokenizer_are_refused_for_an_imported_model(run, other, tmp_path):
    sets = ["--set", f"model.init=hf:{run / 'model'}", "--set",
            f"data.source={run / 'other.bin'}", "--set", "data.seq_len=32"]
    code, lines, output = invoke("run", "--run-dir", tmp_path / "r", "--steps", 1, *sets)
    assert code == 2 and len(lines) == 1, output
    assert f"data.source {run / 'other.bin'} (tokenized with {other})" in lines[0]
    assert f"model.init's folder {run / 'model'} has tokenizer" in lines[0]
    assert "data.other_tokenizer=true" in lines[0]
    code, lines, output = invoke("eval", "--run-dir", tmp_path / "none", "--set",
                                 f"model.init=hf:{run / 'model'}", "--set",
                                 f"eval.source={run / 'other.bin'}", "--set",
                                 "data.seq_len=32")
    assert code == 2 and lines[0].startswith(f"error: eval.source {run / 'other.bin'}"), output


def test_vocabulary_advice_for_an_imported_model_names_its_tokenizer(run, tmp_path):
    big = small_tokenizer(tmp_path / "big", TEXTS)
    big.add_tokens(["zebra", "quagga"])
    big.save(str(tmp_path / "big" / "tokenizer.json"))
    code, _, output = invoke("tokenize", run / "corpus.jsonl", "--tokenizer", tmp_path / "big",
                             "--out", tmp_path / "big.bin")
    assert code == 0, output
    model_vocab = json.loads((run / "model" / "config.json").read_text())["vocab_size"]
    assert big.get_vocab_size() > model_vocab
    code, lines, output = invoke("run", "--run-dir", tmp_path / "r", "--steps", 1,
                                 "--set", f"model.init=hf:{run / 'model'}",
                                 "--set", f"data.source={tmp_path / 'big.bin'}")
    assert code == 2 and len(lines) == 1, output
    assert f"tokenize with model.init's own tokenizer (--tokenizer {run / 'model'})" in lines[0]
    assert "set model.vocab" not in lines[0]


# --------------------------------------------------------------------------------------
# The run dir keeps the tokenizer it trained with
# --------------------------------------------------------------------------------------

def test_the_run_dir_keeps_the_tokenizer_it_trained_with(run):
    record = json.loads((run / "run" / "provenance.json").read_text())
    assert record["tokenizer_fingerprint"] == DocumentTokenizer.load(run / "model").fingerprint
    assert (record["eos_id"], record["bos_id"]) == (1, 0)
    assert model_files(run / "run" / "tokenizer") == {
        name: data for name, data in model_files(run / "model").items()
        if name.startswith("tokenizer")}


def test_retokenized_data_exports_the_trained_tokenizer_and_is_refused_by_eval(run, other,
                                                                              tmp_path):
    """The issue's case: data re-tokenized in place with another tokenizer of the same
    vocabulary size after training."""
    tokens = run / "data" / "tokens.bin"
    retokenize = ["tokenize", run / "corpus.jsonl", "--out", tokens, "--overwrite"]
    assert invoke(*retokenize, "--tokenizer", other)[0] == 0
    try:
        code, lines, output = invoke("export", run / "run", tmp_path / "out")
        assert code == 0, output
        exported = tmp_path / "out"
        assert (exported / "tokenizer.json").read_bytes() == \
            (run / "model" / "tokenizer.json").read_bytes()
        config = json.loads((exported / "config.json").read_text())
        assert (config["eos_token_id"], config["bos_token_id"]) == (1, 0)
        code, lines, output = invoke("eval", "--run-dir", run / "run")
        assert code == 2 and len(lines) == 1, output
        trained = DocumentTokenizer.load(run / "model").fingerprint
        assert f"eval.source {tokens} (tokenized with {other}) has tokenizer fingerprint " \
               f"{DocumentTokenizer.load(other).fingerprint}, but run dir {run / 'run'} " \
               f"trained with tokenizer {trained}" in lines[0]
        assert f"--tokenizer {run / 'run' / 'tokenizer'}" in lines[0]
    finally:
        assert invoke(*retokenize, "--tokenizer", run / "model")[0] == 0


def test_export_needs_neither_the_tokenizer_folder_nor_the_sidecar(run, tmp_path):
    """With the model folder moved, the run dir's copy; with the record gone too (a run dir
    from before records) and the sidecar moved, model.init's folder; eos and bos each time."""
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(run / "model", moved / "model")
    try:
        code, lines, output = invoke("export", run / "run", tmp_path / "a")
        assert code == 0, output
    finally:
        shutil.move(moved / "model", run / "model")
    for name in ("provenance.json", "tokenizer"):
        shutil.move(run / "run" / name, moved / name)
    shutil.move(run / "data" / "tokens.bin.json", moved / "tokens.bin.json")
    try:
        code, lines, output = invoke("export", run / "run", tmp_path / "b")
        assert code == 0, output
        assert lines[-1].endswith(f"tokenizer from model.init's folder {run / 'model'}")
    finally:
        for name in ("provenance.json", "tokenizer"):
            shutil.move(moved / name, run / "run" / name)
        shutil.move(moved / "tokens.bin.json", run / "data" / "tokens.bin.json")
    for out in (tmp_path / "a", tmp_path / "b"):
        assert (out / "tokenizer.json").is_file()
        config = json.loads((out / "config.json").read_text())
        assert (config["eos_token_id"], config["bos_token_id"]) == (1, 0)


def test_export_without_a_known_tokenizer_needs_no_tokenizer(tmp_path):
    (tmp_path / "recipe.yaml").write_text("model: {init: random}\n")  # no record, no folder
    with pytest.raises(RecipeError, match="records no tokenizer .* give --no-tokenizer"):
        shipped_tokenizer(tmp_path, no_tokenizer=False)
    assert shipped_tokenizer(tmp_path, no_tokenizer=True).folder is None


def test_a_run_whose_tokenizer_moved_is_one_line(run, tmp_path):
    shutil.copytree(run / "model", tmp_path / "tok", ignore=shutil.ignore_patterns("*.safet*"))
    assert invoke("tokenize", run / "corpus.jsonl", "--tokenizer", tmp_path / "tok",
                  "--out", tmp_path / "t.bin")[0] == 0
    shutil.rmtree(tmp_path / "tok")
    code, lines, output = invoke("run", "--run-dir", tmp_path / "r", "--steps", 1, "--set",
                                 f"data.source={tmp_path / 't.bin'}", "--set", "model.vocab=384")
    assert code == 2 and len(lines) == 1, output
    assert f"is no longer at {tmp_path / 'tok'} (moved or replaced)" in lines[0]
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_eval_out_follows_the_rules_of_export(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval.json").write_text("an earlier eval")
    (out / "notes.txt").write_text("mine")
    code, lines, output = invoke("eval", "--run-dir", run / "run", "--out", out)
    assert code == 2 and len(lines) == 1, output
    assert f"--out {out}: the folder holds files already" in lines[0]
    code, lines, output = invoke("eval", "--run-dir", run / "run", "--out", run / "model",
                                 "--overwrite")
    assert code == 2 and "is the run's model.init folder" in lines[0], output
    assert (out / "eval.json").read_text() == "an earlier eval"
    code, lines, output = invoke("eval", "--run-dir", run / "run", "--out", out, "--overwrite",
                                 "--json")
    assert code == 0, output
    assert "loss" in json.loads((out / "eval.json").read_text())
    assert (out / "notes.txt").read_text() == "mine"
