"""Nothing a user has is lost: `lctrain export` never writes over a folder that holds files
without --overwrite, never over the run's own model or run dir, and a crash mid-export
leaves the old folder whole; training refuses tokens from a tokenizer other than the
imported model's, and the advice it gives for a vocabulary too small works."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from lctrain.cli.main import app
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
                             "--out", root / "tokens.bin")
    assert code == 0, output
    code, _, output = invoke(
        "run", "--run-dir", root / "run", "--steps", 1, "--set", f"model.init=hf:{root / 'model'}",
        "--set", f"data.source={root / 'tokens.bin'}", "--set", "data.seq_len=32",
        "--set", "data.batch_size=8")
    assert code == 0, output
    return root


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
                                          ("run", "the run dir"), (".", "the run dir")])
def test_export_never_writes_over_the_runs_own_folders(run, target, what):
    before = model_files(run / "model")
    code, lines, output = invoke("export", run / "run", run / target, "--overwrite")
    assert code == 2 and len(lines) == 1, output
    assert what in lines[0] and "never overwritten" in lines[0]
    assert model_files(run / "model") == before


def test_export_with_overwrite_replaces_the_folder_whole(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.safetensors").write_text("from before")
    code, lines, output = invoke("export", run / "run", out, "--overwrite")
    assert code == 0, output
    written = sorted(path.name for path in out.iterdir())
    assert "stale.safetensors" not in written and "config.json" in written
    assert lines[-1].endswith(", ".join(written))  # it lists what it wrote, nothing else
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


def test_tokens_of_another_tokenizer_are_refused_for_an_imported_model(run, tmp_path):
    """The other tokenizer has the model's vocabulary size: only the fingerprint tells."""
    spec = json.loads((run / "model" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(run / "model" / "tokenizer_config.json", other)
    code, _, output = invoke("tokenize", run / "corpus.jsonl", "--tokenizer", other,
                             "--out", tmp_path / "other.bin")
    assert code == 0, output
    sets = ["--set", f"model.init=hf:{run / 'model'}", "--set",
            f"data.source={tmp_path / 'other.bin'}", "--set", "data.seq_len=32"]
    code, lines, output = invoke("run", "--run-dir", tmp_path / "r", "--steps", 1, *sets)
    assert code == 2 and len(lines) == 1, output
    assert f"data.source {tmp_path / 'other.bin'} (tokenized with {other})" in lines[0]
    assert f"model.init's folder {run / 'model'} has tokenizer" in lines[0]
    assert "data.other_tokenizer=true" in lines[0]
    code, lines, output = invoke("eval", "--run-dir", tmp_path / "none", "--set",
                                 f"model.init=hf:{run / 'model'}", "--set",
                                 f"eval.source={tmp_path / 'other.bin'}", "--set",
                                 "data.seq_len=32")
    assert code == 2 and lines[0].startswith(f"error: eval.source {tmp_path / 'other.bin'}"), output


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
