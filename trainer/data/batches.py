"""Deterministic, resumable data sources that produce numpy batches.

Every source answers one question: "what are the rows of global batch number `index`?"
The answer depends only on (config, seed, index, row), never on what was read before, so

* resuming at step n reads exactly what an uninterrupted run would have read, and
* each process of a multi-host job can read just its own rows (`rows=`) and still agree
  with every other process about the global batch.

Three kinds of source, chosen by `DataConfig.source` (or a weighted mixture of the file
kinds, `DataConfig.sources`: trainer/data/mixture.py):

* "synthetic": a copy task (the second half of each row repeats the first half).
* a token file (.npy or raw .bin): one stream of concatenated documents.
* anything else: a text file or a folder of .txt files, tokenized in memory with
  `data.tokenizer` (trainer/data/tokenizer.py) or, without one, byte by byte.

A token file's eos id and element type come from its sidecar (`X.bin.json`, written by
`lctrain tokenize`) when it has one, else from the recipe.

Token files and text share the same windowing: the stream is cut into windows of
seq_len + 1 tokens (inputs are the first seq_len, targets the last seq_len), visited in a
fresh seeded order every epoch. Documents inside a window are told apart by `segment_ids`
so attention and the loss never cross a document boundary.

This module is pure numpy on purpose: it runs on the host, before and beside jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lctrain.recipes.schema import DataConfig
from lctrain.trainer.data.tokenizer import DocumentTokenizer, TokenizerError, token_file_settings
from lctrain.trainer.outputs.failures import DataError

BYTE_EOS = 256  # end-of-document id of the byte tokenizer: the first id after the 256 bytes
EVAL_SEED_OFFSET = 1_000_003  # the seed of the "eval" split is train.seed + this


@dataclass(frozen=True)
class Batch:
    inputs: np.ndarray       # int32 [B, S]
    targets: np.ndarray      # int32 [B, S]  next token of each input
    positions: np.ndarray    # int32 [B, S]  position inside its document (resets per document)
    segment_ids: np.ndarray  # int32 [B, S]  document id inside the row, starting at 1
    loss_mask: np.ndarray    # float32 [B, S] 1 where the target is in the input's document


# --------------------------------------------------------------------------------------
# Byte-level tokenizer
# --------------------------------------------------------------------------------------

def encode_text(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as token ids 0..255 (int32)."""
    return _bytes_to_tokens(text.encode("utf-8"))


def decode_tokens(ids) -> str:
    """Inverse of `encode_text`. Ids outside 0..255 (BYTE_EOS, or anything a model with a
    larger vocabulary samples) carry no bytes and are dropped; broken UTF-8 becomes U+FFFD."""
    ids = np.asarray(ids).reshape(-1)
    byte_ids = ids[(ids >= 0) & (ids < 256)].astype(np.uint8)
    return byte_ids.tobytes().decode("utf-8", errors="replace")


def _bytes_to_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


# --------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------

class DataSource:
    """Base class: subclasses say how to build one window of seq_len + 1 tokens per row;
    turning windows into a `Batch` (and the `rows=` bookkeeping) is shared here."""

    eos_id: int | None = None  # token that ends a document; None: each row is one document

    def __init__(self, cfg: DataConfig, *, vocab: int, seed: int):
        self.cfg = cfg
        self.vocab = vocab
        self.seed = seed

    def batch(self, index: int, rows: slice | None = None) -> Batch:
        """Global batch number `index`, shape [batch_size, seq_len]; `rows` picks a subset
        of its rows and gives exactly `batch(index)` sliced by `rows`."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        row_ids = range(self.cfg.batch_size)[rows if rows is not None else slice(None)]
        windows = np.zeros((len(row_ids), self.cfg.seq_len + 1), np.int64)
        for i, row in enumerate(row_ids):
            windows[i] = self._window(index, row)
        return batch_from_windows(windows, self.eos_id)

    def _window(self, index: int, row: int) -> np.ndarray:
        """The seq_len + 1 tokens of row `row` of global batch `index`."""
        raise NotImplementedError


class SyntheticCopySource(DataSource):
    """Each row: random tokens, then the same tokens again. The second half is perfectly
    predictable from the first, so a working model drives its loss there towards zero."""

    def _window(self, index: int, row: int) -> np.ndarray:
        length = self.cfg.seq_len + 1
        half = (length + 1) // 2  # ceil(length / 2)
        # One generator per (seed, index, row): a row never depends on which other rows
        # were asked for, which is what makes `rows=` slicing exact.
        rng = np.random.default_rng([self.seed, index, row])
        sequence = np.empty(length, np.int64)
        # Ids come from [1, vocab): id 0 never occurs in the task.
        sequence[:half] = rng.integers(1, self.vocab, size=half)
        sequence[half:] = sequence[: length - half]
        return sequence


class WindowedStreamSource(DataSource):
    """A token stream of concatenated documents, cut into overlapping windows.

    Window w is tokens[w*S : w*S + S + 1] (S = seq_len): consecutive windows share one token
    so that every token is a target exactly once per epoch. Sample k of the run
    (k = index * batch_size + row) is window order_e[k % n_windows] of epoch e = k // n_windows,
    where order_e is a permutation seeded by (seed, e).

    With a holdout stride h, windows 0, h, 2h, ... are held out: training permutes the
    others, and the "eval" split reads the held-out ones in file order.
    """

    def __init__(self, tokens: np.ndarray, *, name: str, eos_id: int | None,
                 cfg: DataConfig, vocab: int, seed: int, holdout_stride: int = 0,
                 split: str = "train", window_starts: np.ndarray | None = None):
        super().__init__(cfg, vocab=vocab, seed=seed)
        self.tokens = tokens  # 1-D, may be a memmap: only the windows read get loaded
        self.name = name      # for error messages
        self.eos_id = eos_id
        # Token offset of each window; None: every seq_len-th (w * seq_len).
        self.window_starts = window_starts
        window = cfg.seq_len + 1
        if len(tokens) < window:
            raise DataError(
                f"{name}: has {len(tokens)} tokens, fewer than seq_len + 1 = {window} needed "
                f"for one training window; use more data or a smaller data.seq_len")
        windows = (len(tokens) - 1) // cfg.seq_len if window_starts is None else len(window_starts)
        self.stride = holdout_stride
        held_out = -(-windows // holdout_stride) if holdout_stride else 0
        self.held_out_split = split == "eval" and held_out > 0
        self.n_windows = held_out if self.held_out_split else windows - held_out
        if self.n_windows == 0:
            raise DataError(f"{name}: its {windows} windows of {window} tokens leave none for "
                            f"training once eval.holdout takes every {holdout_stride}th; use "
                            f"more data, a smaller data.seq_len or a smaller eval.holdout")
        self._epoch_orders: dict[int, np.ndarray] = {}

    def _window(self, index: int, row: int) -> np.ndarray:
        return self.sample(index * self.cfg.batch_size + row)

    def sample(self, number: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample `number` of the run."""
        return self._read_window(self._window_of_sample(number))

    def _window_of_sample(self, sample: int) -> int:
        epoch, slot = divmod(sample, self.n_windows)
        if self.held_out_split:
            return slot * self.stride
        kept = int(self._epoch_order(epoch)[slot])
        # The kept-th window that is not a multiple of the stride.
        return kept + kept // (self.stride - 1) + 1 if self.stride else kept

    def _epoch_order(self, epoch: int) -> np.ndarray:
        # A permutation of a big file costs real time and memory, so keep the last couple
        # (a batch can straddle two epochs) instead of recomputing it for every row.
        if epoch not in self._epoch_orders:
            if len(self._epoch_orders) >= 2:
                self._epoch_orders.pop(min(self._epoch_orders))
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_orders[epoch] = rng.permutation(self.n_windows)
        return self._epoch_orders[epoch]

    def window_start(self, window_id):
        """Token offset of window `window_id` (an int or an array of them)."""
        if self.window_starts is None:
            return window_id * self.cfg.seq_len
        return self.window_starts[window_id]

    def split_window_ids(self) -> np.ndarray:
        """Every window this split reads once per epoch."""
        if self.held_out_split:
            return np.arange(self.n_windows) * self.stride
        kept = np.arange(self.n_windows)
        return kept + kept // (self.stride - 1) + 1 if self.stride else kept

    def _read_window(self, window_id: int) -> np.ndarray:
        start = int(self.window_start(window_id))
        # int64 so that uint32 ids above 2**31 are seen as too large, not wrapped negative.
        window = np.asarray(self.tokens[start:start + self.cfg.seq_len + 1], dtype=np.int64)
        self._check_vocab(window, start)
        return window

    def _check_vocab(self, window: np.ndarray, start: int) -> None:
        # Checked per window read rather than over the whole file up front: cheap, and a
        # multi-terabyte file is never scanned just to start training.
        bad = (window < 0) | (window >= self.vocab)
        if bad.any():
            offset = start + int(np.argmax(bad))
            raise DataError(
                f"{self.name}: token {int(window[offset - start])} at token offset {offset} "
                f"(window starting at token {start}) is outside the vocabulary "
                f"[0, {self.vocab}); retokenize the data or raise model.vocab")


# --------------------------------------------------------------------------------------
# Windows -> Batch (shared by every source)
# --------------------------------------------------------------------------------------

def batch_from_windows(windows: np.ndarray, eos_id: int | None) -> Batch:
    """Builds a Batch from token windows [B, S + 1].

    A document ends with `eos_id` (the eos token belongs to the document it ends), so the
    segment id of token j is 1 + the number of eos tokens before j. A target only counts
    when it lies in the same document as its input: predicting the first token of the next
    document from the previous one's eos is not something the model can learn.
    """
    rows, length = windows.shape
    if eos_id is None:
        is_eos = np.zeros((rows, length), bool)
    else:
        is_eos = windows == eos_id
    eos_before = np.cumsum(is_eos, axis=1) - is_eos
    segments = 1 + eos_before

    # A document starts at position 0 and right after every eos; a token's position is its
    # distance from the latest start at or before it.
    index = np.broadcast_to(np.arange(length), (rows, length))
    starts_here = np.zeros((rows, length), bool)
    starts_here[:, 0] = True
    starts_here[:, 1:] = is_eos[:, :-1]
    latest_start = np.maximum.accumulate(np.where(starts_here, index, 0), axis=1)
    positions = index - latest_start

    return Batch(
        inputs=windows[:, :-1].astype(np.int32),
        targets=windows[:, 1:].astype(np.int32),
        positions=positions[:, :-1].astype(np.int32),
        segment_ids=segments[:, :-1].astype(np.int32),
        loss_mask=(segments[:, :-1] == segments[:, 1:]).astype(np.float32),
    )


# --------------------------------------------------------------------------------------
# Opening sources (all file errors surface here, before training starts)
# --------------------------------------------------------------------------------------

def open_stream(path: Path, cfg: DataConfig, vocab: int, *,
                key: str) -> tuple[np.ndarray, int | None]:
    """The token stream of a token file or text source and the id that ends its documents;
    `key` is the recipe key that named `path`, for the error."""
    synthetic = "'synthetic', " if key == "data.source" else ""  # a mixture reads files
    if not path.exists():
        raise DataError(
            f"{path}: no such file or folder (looked for {path.absolute()}); set {key} "
            f"to {synthetic}a .bin/.npy token file, or a text file / folder of .txt files")
    if path.suffix in (".npy", ".bin"):
        return _open_token_file(path, cfg, vocab)
    return _open_text(path, cfg.tokenizer, vocab)


def _open_token_file(path: Path, cfg: DataConfig, vocab: int) -> tuple[np.ndarray, int | None]:
    """The tokens of a .bin/.npy file and the id that ends its documents."""
    try:
        eos_id, dtype = token_file_settings(path, eos_id=cfg.eos_id,
                                            token_dtype=cfg.token_dtype, model_vocab=vocab)
    except TokenizerError as err:
        raise DataError(str(err)) from None
    tokens = _load_npy(path) if path.suffix == ".npy" else _load_bin(path, dtype)
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise DataError(
            f"{path}: data.eos_id {eos_id} is outside the vocabulary [0, {vocab}); "
            f"set data.eos_id to the tokenizer's end-of-document id")
    return tokens, eos_id


def _open_text(path: Path, tokenizer_path: str | None, vocab: int) -> tuple[np.ndarray, int]:
    """The documents of a text source, tokenized, and the id that ends each."""
    if tokenizer_path is None:
        if vocab <= BYTE_EOS:
            raise DataError(
                f"{path}: text uses the byte tokenizer (256 bytes + end-of-document id "
                f"{BYTE_EOS}), which needs model.vocab >= {BYTE_EOS + 1}, got {vocab}")
        return _load_text(path, None), BYTE_EOS
    try:
        tokenizer = DocumentTokenizer.load(tokenizer_path, key="data.tokenizer")
        tokenizer.check_vocab(vocab, key="data.tokenizer")
    except TokenizerError as err:
        raise DataError(str(err)) from None
    return _load_text(path, tokenizer), tokenizer.eos_id


def _load_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as error:
        raise DataError(f"{path}: not a readable .npy file ({error}); re-save it with "
                        f"np.save(path, tokens)") from error
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(
            f"{path}: holds a {tokens.dtype} array of shape {tokens.shape}, but a token file "
            f"must be a 1-D integer array; flatten it and save as e.g. uint16/uint32/int32")
    if tokens.size == 0:
        raise DataError(f"{path}: is empty (0 tokens); point data.source at a tokenized file")
    return tokens


def _load_bin(path: Path, dtype_name: str) -> np.ndarray:
    dtype = np.dtype(dtype_name)
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: is empty (0 bytes); point data.source at a tokenized file")
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: size {size} bytes is not a multiple of {dtype.itemsize} ({dtype_name}), "
            f"so the file is truncated or data.token_dtype is wrong; re-export the file or "
            f"set data.token_dtype to the dtype it was written with")
    return np.memmap(path, dtype=dtype, mode="r")


def files_under(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files below folder `path` (recursively) with one of `suffixes`, in a fixed order."""
    return sorted(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())


def text_of(data: bytes) -> str:
    """A text file's contents for a tokenizer that takes str: read as bytes (so no newline
    translation), and bytes that are not UTF-8 become U+FFFD rather than stop a run."""
    return data.decode("utf-8", errors="replace")


def _load_text(path: Path, tokenizer: DocumentTokenizer | None) -> np.ndarray:
    """All documents as one in-memory stream, each file one document ending with its eos:
    `tokenizer`'s ids, or without one the file's bytes followed by BYTE_EOS."""
    if path.is_dir():
        files = files_under(path, (".txt",))
        if not files:
            raise DataError(f"{path}: folder has no .txt files (searched recursively); "
                            f"add some, or point data.source at a token file")
    else:
        files = [path]
    contents = [f.read_bytes() for f in files]
    contents = [data for data in contents if data]  # an empty file is no document
    if not contents:
        raise DataError(f"{path}: every text file is empty; add text to train on")
    if tokenizer is None:
        documents = [np.append(_bytes_to_tokens(data), BYTE_EOS) for data in contents]
    else:
        documents = tokenizer.encode_documents([text_of(data) for data in contents])
    return np.concatenate([np.asarray(doc, np.int32) for doc in documents])
