"""Tests for trainer/data/mixture.py (data.sources): shares, determinism, filters, bad data.

The token files are built so that every token says where it came from: a document of L
tokens is [BOS, v, v, ..., v, EOS] with v = offset + L, so a row's tokens tell its source
(by offset), each document's length, and (BOS) where a document starts.
"""

from __future__ import annotations

import json
import dataclasses
import math

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.recipes import RecipeError, load_recipe
from lctrain.recipes.schema import DataConfig, SourceConfig
from lctrain.trainer.data.mixture import MixtureSource, long_token_share, tokens_per_source
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.data.tokenizer import DocumentTokenizer, data_tokenizer, write_sidecar

EOS, BOS = 0, 1
VOCAB = 128
OFFSETS = (0, 60)  # source 0's values are 3..59, source 1's 63..119


def document_tokens(lengths, offset) -> np.ndarray:
    return np.concatenate([[BOS, *[offset + n] * (n - 2), EOS] for n in lengths])


def write_docs(path, lengths, offset):
    np.save(path, document_tokens(lengths, offset).astype(np.int32))
    return str(path)


def random_lengths(seed, count=300, low=3, high=60):
    return np.random.default_rng(seed).integers(low, high, count)


def mixture(tmp_path, *specs, seq_len=32, batch_size=8, seed=0, lengths=None) -> MixtureSource:
    """A mixture of len(specs) sources (dicts of SourceConfig fields but path)."""
    sources = []
    for i, spec in enumerate(specs):
        doc_lengths = random_lengths(i) if lengths is None else lengths[i]
        path = write_docs(tmp_path / f"s{i}.npy", doc_lengths, OFFSETS[i])
        sources.append(SourceConfig(path=path, **spec))
    cfg = DataConfig(seq_len=seq_len, batch_size=batch_size, eos_id=EOS, sources=sources)
    return make_source(cfg, vocab=VOCAB, seed=seed)


def source_of_rows(inputs: np.ndarray) -> np.ndarray:
    """Which source each row's tokens came from (by their values)."""
    content = np.where(inputs > BOS, inputs, 0)
    return (content.max(axis=1) > OFFSETS[1]).astype(int)


def assert_batches_equal(a, b):
    for name in ("inputs", "targets", "positions", "segment_ids", "loss_mask"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# --------------------------------------------------------------------------------------
# Shares, determinism, resume
# --------------------------------------------------------------------------------------

def test_token_shares_match_the_weights_within_binomial_tolerance(tmp_path):
    source = mixture(tmp_path, {"weight": 3.0}, {"weight": 1.0})
    batches = 400
    rows = np.concatenate([source_of_rows(source.batch(i).inputs) for i in range(batches)])
    n, p = len(rows), 0.75
    # Each row is an independent draw: source 0's row count is Binomial(n, p), and every
    # row is seq_len tokens, so token shares are row shares. 4.5 standard deviations:
    # a correct mixture fails with probability < 1e-5.
    tolerance = 4.5 * math.sqrt(n * p * (1 - p))
    assert abs(np.count_nonzero(rows == 0) - n * p) <= tolerance
    counts = tokens_per_source(source, 0, batches)
    assert list(counts.values()) == [np.count_nonzero(rows == c) * 32 for c in (0, 1)]


def test_source_ids_say_which_source_each_row_read(tmp_path):
    source = mixture(tmp_path, {"weight": 1.0}, {"weight": 1.0})
    for index in range(5):
        batch = source.batch(index)
        np.testing.assert_array_equal(source.last_source_ids, source_of_rows(batch.inputs))
        np.testing.assert_array_equal(source.source_ids(index), source.last_source_ids)


def test_same_seed_and_index_give_the_same_batch_and_rows_slice_it(tmp_path):
    a = mixture(tmp_path, {"weight": 2.0}, {"weight": 1.0})
    b = mixture(tmp_path, {"weight": 2.0}, {"weight": 1.0})
    for index in (0, 9, 4):
        full = a.batch(index)
        assert_batches_equal(full, b.batch(index))
        for rows in (slice(0, 4), slice(4, 8), slice(1, None, 3)):
            part = b.batch(index, rows=rows)
            for name in ("inputs", "targets", "positions", "segment_ids", "loss_mask"):
                np.testing.assert_array_equal(getattr(part, name), getattr(full, name)[rows])
    other_seed = mixture(tmp_path, {"weight": 2.0}, {"weight": 1.0}, seed=1)
    assert not np.array_equal(other_seed.batch(0).inputs, a.batch(0).inputs)


def test_resume_reads_what_an_uninterrupted_run_read(tmp_path):
    uninterrupted = mixture(tmp_path, {"weight": 1.0}, {"weight": 3.0})
    history = [uninterrupted.batch(i) for i in range(12)]
    resumed = mixture(tmp_path, {"weight": 1.0}, {"weight": 3.0})  # fresh, no state
    for index in (11, 3, 7, 8):  # jumps back and forth
        assert_batches_equal(resumed.batch(index), history[index])


def test_each_source_reads_every_window_once_per_epoch(tmp_path):
    # Source 1 is tokens 0..40 without eos at seq_len 4: 10 windows, window w starting
    # with token 4w. Whatever its weight, its first 10 rows are the 10 windows.
    counting = tmp_path / "count.npy"
    np.save(counting, np.arange(41, dtype=np.int32) + 70)
    first = write_docs(tmp_path / "docs.npy", random_lengths(0), 0)
    cfg = DataConfig(seq_len=4, batch_size=8, sources=[
        SourceConfig(path=first, weight=3.0), SourceConfig(path=str(counting), weight=1.0)])
    source = make_source(cfg, vocab=VOCAB, seed=0)
    starts = []
    for index in range(40):
        batch = source.batch(index)
        starts += list(batch.inputs[source.last_source_ids == 1, 0])
    assert len(starts) >= 20
    windows = (np.array(starts) - 70) // 4
    for epoch in (windows[:10], windows[10:20]):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(10))


def test_held_out_windows_of_every_source_stay_out_of_training(tmp_path):
    # Two counting files (tokens 0..40 and 50..90, seq_len 4: 10 windows each); holdout 0.5
    # holds out windows 0, 2, 4, ... of each: evaluation reads only those, training never.
    paths = []
    for i, first in enumerate((0, 50)):
        np.save(tmp_path / f"c{i}.npy", np.arange(first, first + 41, dtype=np.int32))
        paths.append(str(tmp_path / f"c{i}.npy"))
    cfg = DataConfig(seq_len=4, batch_size=8, sources=[SourceConfig(path=p) for p in paths])
    for split, parity in (("train", 1), ("eval", 0)):
        source = make_source(cfg, vocab=VOCAB, seed=0, split=split, holdout=0.5)
        starts = np.concatenate([source.batch(i).inputs[:, 0] for i in range(6)])
        assert set(((starts % 50) // 4) % 2) == {parity}, split


# --------------------------------------------------------------------------------------
# Length filters, start_at_document, long-token share
# --------------------------------------------------------------------------------------

def segment_lengths_by_value(batch, row, offset):
    """(length of the segment inside the row, document length its tokens state,
    whether the segment lies wholly inside the row) for each segment of one row."""
    segments = batch.segment_ids[row]
    found = []
    for segment in np.unique(segments):
        tokens = batch.inputs[row][segments == segment]
        values = tokens[tokens > BOS] - offset
        inside = segment not in (segments[0], segments[-1])
        found.append((len(tokens), int(values[0]) if len(values) else None, inside))
    return found


def test_length_filters_keep_only_documents_within_bounds(tmp_path):
    source = mixture(tmp_path, {"max_doc_tokens": 20}, {"min_doc_tokens": 30}, seq_len=64)
    seen = {0: set(), 1: set()}
    for index in range(30):
        batch = source.batch(index)
        for row, from_source in enumerate(source.last_source_ids):
            for length, stated, inside in segment_lengths_by_value(batch, row,
                                                                   OFFSETS[from_source]):
                if stated is None:
                    continue  # only BOS/EOS of a cut document in this row
                seen[from_source].add(stated)
                if inside:  # a document wholly in the row: its real length
                    assert length == stated
                if from_source == 0:
                    assert length <= stated <= 20
                else:
                    assert stated >= 30
    assert max(seen[0]) == 20 and min(seen[1]) == 30, "the bounds are inclusive"


def test_start_at_document_windows_begin_at_a_document(tmp_path):
    source = mixture(tmp_path, {"weight": 1.0}, {"weight": 1.0, "start_at_document": True})
    first_tokens = {0: [], 1: []}
    for index in range(20):
        batch = source.batch(index)
        for row, from_source in enumerate(source.last_source_ids):
            first_tokens[from_source].append(batch.inputs[row, 0])
            if from_source == 1:
                assert batch.positions[row, 0] == 0 and batch.inputs[row, 0] == BOS
    assert set(first_tokens[1]) == {BOS}
    assert set(first_tokens[0]) != {BOS}, "without it windows start anywhere"


def expected_long_share(lengths, starts, seq_len, threshold) -> float:
    """By brute force: each token of the stream labelled with its document's length."""
    document_length = np.repeat(lengths, lengths)
    return float(np.mean([document_length[s:s + seq_len] > threshold for s in starts]))


def test_long_token_share_against_brute_force(tmp_path):
    lengths = [random_lengths(0), random_lengths(1, low=3, high=120)]
    source = mixture(tmp_path, {"weight": 3.0},
                     {"weight": 1.0, "min_doc_tokens": 10, "start_at_document": True},
                     lengths=lengths)
    plain, filtered = source.components
    kept = lengths[1][lengths[1] >= 10]
    plain_windows = np.arange(plain.n_windows) * 32
    filtered_starts = np.concatenate([[0], np.cumsum(kept)[:-1]])
    filtered_starts = filtered_starts[filtered_starts + 33 <= kept.sum()]
    expected = [expected_long_share(lengths[0], plain_windows, 32, 40),
                expected_long_share(kept, filtered_starts, 32, 40)]
    assert long_token_share(plain, 40) == pytest.approx(expected[0])
    assert long_token_share(filtered, 40) == pytest.approx(expected[1])
    assert long_token_share(source, 40) == pytest.approx(0.75 * expected[0] + 0.25 * expected[1])
    assert 0 < expected[0] < expected[1] < 1


# --------------------------------------------------------------------------------------
# Recipes: lists of sections, and every bad-data error through `lctrain run`
# --------------------------------------------------------------------------------------

def sources_override(*specs) -> str:
    return "data.sources=" + yaml.safe_dump(list(specs), default_flow_style=True).strip()


def test_sources_load_as_typed_sections_and_round_trip(tmp_path):
    a = write_docs(tmp_path / "a.npy", random_lengths(0), 0)
    recipe = load_recipe("tiny", [sources_override({"path": a, "weight": 2, "max_doc_tokens": 30}),
                                "data.eos_id=0", "data.seq_len=32"])
    assert recipe.data.sources == [SourceConfig(path=a, weight=2.0, max_doc_tokens=30)]
    saved = tmp_path / "recipe.yaml"
    saved.write_text(yaml.safe_dump(recipe.to_dict()))
    assert load_recipe(str(saved)).data == recipe.data
    assert "source" not in recipe.to_dict()["data"]
    assert "sources" not in load_recipe("tiny").to_dict()["data"]  # old run dirs still resume


@pytest.mark.parametrize("value, words", [
    ("5", "'data.sources': got 5; expected a list"),
    ("[{pth: a.npy}]", "unknown recipe key 'data.sources[0].pth'"),
    ("[{path: a.npy, weight: lots}]", "'data.sources[0].weight': got 'lots'"),
])
def test_malformed_sources_name_the_key(value, words):
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", [f"data.sources={value}"])
    assert words in str(err.value)


def run_fails(tmp_path, *overrides) -> str:
    sets = [arg for override in overrides for arg in ("--set", override)]
    result = CliRunner().invoke(app, ["run", *sets, "--set", "data.seq_len=32",
                                      "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


def two_bin_files(tmp_path, first_info, second_info):
    paths = []
    for i, info in enumerate((first_info, second_info)):
        path = tmp_path / f"t{i}.bin"
        document_tokens(random_lengths(i), OFFSETS[i]).astype(np.uint16).tofile(path)
        write_sidecar(path, {"dtype": "uint16", **info})
        paths.append(str(path))
    return paths


SIDECAR = {"tokenizer": "models/llama", "eos_id": 0, "vocab_size": 120}


@pytest.mark.parametrize("field, value", [("tokenizer", "models/qwen"), ("eos_id", 2),
                                          ("vocab_size", 100)])
def test_sources_with_different_tokenizers_are_refused(tmp_path, field, value):
    first, second = two_bin_files(tmp_path, SIDECAR, {**SIDECAR, field: value})
    line = run_fails(tmp_path, sources_override({"path": first}, {"path": second}))
    assert f"data.sources[1].path = '{second}': its {field} {value!r} differs from " \
           f"data.sources[0]'s ({SIDECAR[field]!r})" in line and "retokenize" in line


def test_the_same_tokenizer_mixes(tmp_path):
    first, second = two_bin_files(tmp_path, SIDECAR, SIDECAR)
    recipe = load_recipe("tiny", [sources_override({"path": first}, {"path": second}),
                                "data.seq_len=32"])
    assert make_source(recipe.data, vocab=VOCAB, seed=0).eos_id == 0


def test_a_length_filter_that_keeps_nothing(tmp_path):
    a = write_docs(tmp_path / "a.npy", random_lengths(0), 0)
    line = run_fails(tmp_path, sources_override({"path": a, "min_doc_tokens": 1000}),
                     "data.eos_id=0")
    assert f"data.sources[0]: no document of {a} is 1000..any tokens long" in line
    assert "widen data.sources[0].min_doc_tokens / data.sources[0].max_doc_tokens" in line


def test_an_empty_source_file(tmp_path):
    a = write_docs(tmp_path / "a.npy", random_lengths(0), 0)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    line = run_fails(tmp_path, sources_override({"path": a}, {"path": str(empty)}),
                     "data.eos_id=0")
    assert f"data.sources[1].path: {empty}: is empty (0 bytes)" in line


@pytest.mark.parametrize("weights, words", [
    ((0, 0), "recipe key 'data.sources' = [0.0, 0.0]: the weights must add up to a positive"),
    ((1, -1), "recipe key 'data.sources[1].weight' = -1.0: must be a number >= 0"),
])
def test_weights_must_be_shares(tmp_path, weights, words):
    a = write_docs(tmp_path / "a.npy", random_lengths(0), 0)
    line = run_fails(tmp_path, sources_override(*({"path": a, "weight": w} for w in weights)),
                     "data.eos_id=0")
    assert words in line


def test_data_source_and_sources_together(tmp_path):
    a = write_docs(tmp_path / "a.npy", random_lengths(0), 0)
    line = run_fails(tmp_path, sources_override({"path": a}), f"data.source={a}",
                     "data.eos_id=0")
    assert f"recipe key 'data.source' = '{a}': data.sources is set too" in line


def test_evaluation_with_its_own_source_leaves_the_mixture(tmp_path):
    a = write_docs(tmp_path / "a.npy", random_lengths(0), 0)
    recipe = load_recipe("tiny", [sources_override({"path": a}), "data.eos_id=0",
                                "eval.source=synthetic"])
    assert recipe.for_evaluation().data.sources == []
    assert dataclasses.replace(recipe, eval=dataclasses.replace(recipe.eval, source=None)
                               ).for_evaluation().data.sources == recipe.data.sources


def test_a_run_logs_tokens_per_source_and_the_long_share(tmp_path):
    """`lctrain run` on a mixture: the first lines say how much of the data is long, and
    every metrics record holds each source's tokens since the last one, which add up to
    the batch's tokens and follow the mixture's own count."""
    a = write_docs(tmp_path / "a.npy", random_lengths(0), 0)
    b = write_docs(tmp_path / "b.npy", random_lengths(1), 60)
    sets = [sources_override({"path": a, "weight": 3}, {"path": b, "weight": 1}),
            "data.eos_id=0", "data.seq_len=32", "data.batch_size=8", "train.steps=3",
            "runtime.log_every=1", "model.vocab=128", "model.layers=1"]
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "tiny", *[x for s in sets for x in ("--set", s)],
                                      "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    source = make_source(load_recipe("tiny", sets).data, vocab=128, seed=0)
    assert f"{long_token_share(source, 32):.1%} of the tokens lie in documents longer" \
        in result.output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in line]
    for index, record in enumerate(records):
        counts = {k.removeprefix("tokens/"): v for k, v in record.items()
                  if k.startswith("tokens/")}
        assert counts == tokens_per_source(source, index, index + 1)
        assert sum(counts.values()) == 8 * 32


def test_the_tokenizer_of_a_mixture_is_its_sources(tmp_path, monkeypatch):
    """Evaluation's needles and the HF export read the tokenizer from the sources' sidecars
    (data.source is unset under a mixture)."""
    first, second = two_bin_files(tmp_path, SIDECAR, SIDECAR)
    recipe = load_recipe("tiny", [sources_override({"path": first}, {"path": second}),
                                "data.seq_len=32"])
    monkeypatch.setattr(DocumentTokenizer, "load", classmethod(lambda cls, path: path))
    assert data_tokenizer(recipe.data) == SIDECAR["tokenizer"]
