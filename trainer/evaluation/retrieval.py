"""Needle and passkey retrieval (eval.task): does the model find a fact anywhere in its
window?

Each sample is a haystack of `length` tokens with a needle placed at a `depth` (0 = the
start, 1 = just before the question), then a question and its answer. Scoring is teacher
forced: a sample counts as retrieved when every answer token is the argmax at its
position. That is one forward pass, no decoding loop, so it runs under every strategy.
A sample fills the start of a row of data.seq_len tokens; the rest of the row is another
document (segment), which attention never crosses and the score never counts.

Text: with the data's tokenizer (data.tokenizer or a token file's sidecar) or the byte
tokenizer; the filler is the evaluation source's own tokens, or a repeated neutral
paragraph for synthetic data. A model whose vocabulary is too small for text (the tiny
copy-task model) gets token-level samples: the key and value are random token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lctrain.recipes.schema import Recipe, RecipeError
from lctrain.trainer.data.batches import BYTE_EOS, Batch, DataSource, encode_text
from lctrain.trainer.data.tokenizer import data_tokenizer
from lctrain.trainer.state.step import BATCH_FIELDS

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
WORDS = ("amber", "river", "copper", "falcon", "meadow", "lantern", "harbor", "violet",
         "cedar", "summit", "quartz", "willow", "ember", "glacier", "orchid", "canyon")


@dataclass(frozen=True)
class Sample:
    needle: list[int]
    question: list[int]
    answer: list[int]


class Pieces:
    """Turns the task's sentences into token ids: text, or token-level without a tokenizer."""

    def __init__(self, recipe: Recipe):
        self.tokenizer = data_tokenizer(recipe.data)
        self.vocab = recipe.model.vocab
        self.text = self.tokenizer is not None or self.vocab > BYTE_EOS
        self.bos = ([self.tokenizer.bos_id] if self.tokenizer and self.tokenizer.bos_id
                    is not None and self.tokenizer.add_bos else [])

    def encode(self, text: str) -> list[int]:
        if self.tokenizer:
            return self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        return encode_text(text).tolist()

    def sample(self, task: str, rng: np.random.Generator) -> Sample:
        if not self.text:
            key, value = rng.integers(1, self.vocab, 2), rng.integers(1, self.vocab, 4)
            return Sample([*key, *value], list(key), list(value))
        if task == "passkey":
            digits = str(rng.integers(10_000, 100_000))
            return Sample(self.encode(f" The pass key is {digits}. Remember it. {digits} is "
                                      f"the pass key. "),
                          self.encode(" What is the pass key? The pass key is"),
                          self.encode(f" {digits}."))
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        value = str(rng.integers(1_000_000, 10_000_000))
        return Sample(self.encode(f" One of the special magic numbers for {key} is: {value}. "),
                      self.encode(f" What is the special magic number for {key}? The special "
                                  f"magic number for {key} is:"),
                      self.encode(f" {value}"))

    def filler(self, rng: np.random.Generator, count: int, source: DataSource | None,
               row: int) -> np.ndarray:
        if source is not None:
            tokens = np.concatenate([source.batch(i, rows=slice(row, row + 1)).inputs[0]
                                     for i in range(-(-count // source.cfg.seq_len))])
            return tokens[:count]
        if self.text:
            paragraph = self.encode(FILLER)
            return np.resize(np.asarray(paragraph), count)
        return rng.integers(1, self.vocab, count)


def check_retrieval(recipe: Recipe) -> None:
    """RecipeError unless evaluation's sequences hold a retrieval sample (eval.task needle or
    passkey): part of phase 2 of the checks, as the sample's length comes from the
    tokenizer's files."""
    if recipe.eval.task != "loss":
        grid(recipe.for_evaluation())


def grid(recipe: Recipe) -> tuple[list[int], list[float]]:
    """Haystack lengths, log-spaced from seq_len / 16 (at least twice a sample's needle,
    question and answer) up to the evaluated sequence, and needle depths."""
    seq_len, count = recipe.data.seq_len, recipe.eval.lengths
    pieces = Pieces(recipe)
    sample = pieces.sample(recipe.eval.task, np.random.default_rng(0))
    shortest = 2 * (len(pieces.bos) + len(sample.needle) + len(sample.question)
                    + len(sample.answer))
    if shortest > seq_len:
        raise RecipeError(f"eval.seq_len: {seq_len} tokens cannot hold a {recipe.eval.task} "
                          f"haystack around its needle, question and answer ({shortest // 2} "
                          f"tokens); use eval.seq_len >= {shortest}")
    first = min(max(seq_len // 16, shortest), seq_len)
    lengths = np.geomspace(first, seq_len, count) if count > 1 else np.array([seq_len])
    depths = np.linspace(0, 1, recipe.eval.depths) if recipe.eval.depths > 1 else np.zeros(1)
    return np.unique(np.round(lengths).astype(int)).tolist(), depths.tolist()


def sample_row(pieces: Pieces, sample: Sample, length: int, depth: float, seq_len: int,
               filler: np.ndarray) -> tuple[np.ndarray, int]:
    """A window of seq_len + 1 tokens: bos, haystack with the needle at `depth`, question,
    answer (`length` tokens together), then filler as another document; and where the
    answer starts."""
    tail = sample.question + sample.answer
    hay = length - len(pieces.bos) - len(sample.needle) - len(tail)
    if hay < 0:
        raise RecipeError(f"eval.lengths: a haystack of {length} tokens is shorter than its "
                          f"needle, question and answer ({length - hay} tokens); raise "
                          f"eval.seq_len or lower eval.lengths")
    cut = int(round(depth * hay))
    body = [*pieces.bos, *filler[:cut], *sample.needle, *filler[cut:hay], *tail]
    window = np.concatenate([body, filler[:seq_len + 1 - length]]).astype(np.int64)
    return window, length - len(sample.answer)


def retrieval_batch(windows: list[np.ndarray], answers: list[tuple[int, int]],
                    length: int) -> Batch:
    """Rows of one (length, depth) cell; only the answer tokens are counted, each row's
    with the row's number from 1 (an answer is one string, as evaluate.make_string_misses
    counts them)."""
    windows = np.stack(windows)
    rows, width = windows.shape[0], windows.shape[1] - 1
    index = np.arange(width)
    segment = np.where(index < length, 1, 2)
    mask = np.zeros((rows, width), np.float32)
    for row, (start, size) in enumerate(answers):
        mask[row, start - 1:start - 1 + size] = row + 1  # the inputs predicting the answer
    return Batch(windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32),
                 np.broadcast_to(np.where(index < length, index, index - length),
                                 (rows, width)).astype(np.int32),
                 np.broadcast_to(segment, (rows, width)).astype(np.int32), mask)


def cell_batches(recipe: Recipe, source: DataSource | None, seed: int):
    """(length, depth, Batch) for every cell of the grid, batch_size samples each."""
    pieces = Pieces(recipe)
    lengths, depths = grid(recipe)
    seq_len, rows = recipe.data.seq_len, recipe.data.batch_size
    for i, length in enumerate(lengths):
        for j, depth in enumerate(depths):
            rng = np.random.default_rng([seed, i, j])
            windows, answers = [], []
            for row in range(rows):
                sample = pieces.sample(recipe.eval.task, rng)
                filler = pieces.filler(rng, seq_len + 1, source, row)
                window, start = sample_row(pieces, sample, length, depth, seq_len, filler)
                windows.append(window)
                answers.append((start, len(sample.answer)))
            yield length, depth, retrieval_batch(windows, answers, length)


class OneBatch:
    """A fixed Batch served as a data source (what device_batch reads)."""

    def __init__(self, cfg, batch: Batch):
        self.cfg, self._batch = cfg, batch

    def batch(self, index: int, rows: slice | None = None) -> Batch:
        rows = rows if rows is not None else slice(None)
        return Batch(*(getattr(self._batch, name)[rows] for name in BATCH_FIELDS))
