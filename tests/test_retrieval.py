"""Needle and passkey samples: the needle sits at its depth, the answer is the counted
tokens and nothing else, with the byte tokenizer and with a Hugging Face tokenizer.
(Scoring against a model known to copy: tests/test_train.py.)"""

import json

import numpy as np
import pytest

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.data.batches import decode_tokens
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.evaluation.retrieval import Pieces, cell_batches, grid

from test_export import small_tokenizer


NEEDLE_START = {"needle": " One of the special magic numbers", "passkey": " The pass key is"}
NEEDLE_END = {"needle": "{value}. ", "passkey": "{value} is the pass key. "}


def answers_and_needles(recipe, decode, source=None):
    """Per cell: the decoded answer of every row, and the decoded row."""
    for length, depth, batch in cell_batches(recipe, source, seed=0):
        rows = []
        for row in range(batch.inputs.shape[0]):
            counted = batch.loss_mask[row] > 0
            sample = batch.inputs[row][batch.segment_ids[row] == 1]
            assert len(sample) == length and counted[:length].sum() == counted.sum()
            rows.append((decode(batch.targets[row][counted]), decode(sample)))
        yield length, depth, rows


@pytest.mark.parametrize("task", ["needle", "passkey"])
def test_byte_tokenizer_samples(task):
    recipe = load_recipe("tiny", ["model.vocab=300", f"eval.task={task}", "data.seq_len=512",
                                "eval.lengths=2", "eval.depths=3", "data.batch_size=2"])
    lengths, depths = grid(recipe)
    assert lengths[-1] == 512 and 120 < lengths[0] < 512 and depths == [0.0, 0.5, 1.0]
    for length, depth, rows in answers_and_needles(recipe, decode_tokens):
        for answer, text in rows:
            value = answer.strip().rstrip(".")
            assert value.isdigit() and len(value) == (7 if task == "needle" else 5)
            assert text.endswith(answer) and text.count(value) >= 2
            # One byte per token: the needle starts after round(depth * haystack) bytes.
            start, end = NEEDLE_START[task], NEEDLE_END[task]
            needle_at = text.index(start)
            needle_end = text.index(end.format(value=value), needle_at) + len(
                end.format(value=value))
            question = len(text) - text.rindex(" What is") - len(answer)
            haystack = length - (needle_end - needle_at) - question - len(answer)
            assert needle_at == round(depth * haystack), (depth, needle_at, haystack)


def test_hf_tokenizer_samples_take_filler_from_the_source(tmp_path):
    texts = [f"document {i} talks about rivers and meadows at length." for i in range(60)]
    tokenizer = small_tokenizer(tmp_path / "tok", texts)
    (tmp_path / "corpus.txt").write_text(" ".join(texts))
    recipe = load_recipe("tiny", [f"model.vocab={tokenizer.get_vocab_size()}",
                                f"data.tokenizer={tmp_path / 'tok'}",
                                f"data.source={tmp_path / 'corpus.txt'}", "data.seq_len=512",
                                "eval.task=needle", "eval.lengths=1", "eval.depths=2",
                                "data.batch_size=2"])
    source = make_source(recipe.data, vocab=recipe.model.vocab, seed=0, split="eval")
    decode = lambda ids: tokenizer.decode([int(i) for i in ids])
    for _, _, rows in answers_and_needles(recipe, decode, source):
        for answer, text in rows:
            assert answer.strip().isdigit() and "magic number" in text and "meadows" in text
    assert Pieces(recipe).tokenizer is not None


def test_needle_longer_than_its_haystack_is_an_error():
    recipe = load_recipe("tiny", ["model.vocab=300", "eval.task=passkey", "data.seq_len=32",
                                "eval.lengths=1"])
    with pytest.raises(RecipeError, match="cannot hold a passkey haystack"):
        next(cell_batches(recipe, None, seed=0))
