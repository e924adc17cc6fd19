"""Weighted mixtures of token sources (`data.sources`), with per-source document filters.

Long-context recipes (ProLong, Llama 3.1's staged extension) train on a mixture: long
documents (books, code repositories) upsampled, short high-quality data kept in. Here each
row of a batch comes from one source, drawn with probability weight / sum of weights.
Because every row is seq_len tokens of one source, the weights are shares of TOKENS, not
of documents (a source of short documents gets the same tokens as one of long ones).

The draw for sample k = index * batch_size + row is a hash of (seed, k): a pure function,
so resume and `rows=` slicing stay exact. Source c then reads its own sample number j (how
many earlier samples drew c), so each source walks its own seeded epochs and visits every
one of its windows once per epoch, whatever its weight.

A source's documents (delimited by its eos) may be filtered by length; the kept documents
form one stream, windowed as data.source is. With start_at_document, windows begin only at
the start of a (kept) document and run on into the documents after it (packed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lctrain.recipes.schema import DataConfig, SourceConfig
from lctrain.trainer.data.batches import (BYTE_EOS, Batch, DataSource, WindowedStreamSource,
                                          open_stream)
from lctrain.trainer.data.tokenizer import TokenizerError, read_sidecar
from lctrain.trainer.outputs.failures import DataError

SCAN_CHUNK = 1 << 24          # tokens per pass when finding the eos tokens of a big file
COUNT_CHUNK = 1 << 22         # samples per pass when counting past draws
COMPONENT_SEED_STRIDE = 7_919  # each source gets its own window orders
MIX_SALT = 0x6D6978            # keeps the source draw apart from the window orders


# --------------------------------------------------------------------------------------
# Documents and filtered views
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Documents:
    """Where each document of a stream starts and how many tokens it has (its eos included);
    a stream's tail without an eos is a document too."""
    starts: np.ndarray   # int64
    lengths: np.ndarray  # int64


def documents_of(tokens, eos_id: int | None) -> Documents:
    """The documents of a token stream (a memmap is read in chunks, never whole)."""
    size = len(tokens)
    if eos_id is None:
        return Documents(np.zeros(1, np.int64), np.array([size], np.int64))
    ends = [np.flatnonzero(np.asarray(tokens[at:at + SCAN_CHUNK]) == eos_id) + at + 1
            for at in range(0, size, SCAN_CHUNK)]
    ends = np.concatenate([*ends, np.zeros(0, np.int64)]).astype(np.int64)
    if not len(ends) or ends[-1] != size:
        ends = np.append(ends, size)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return Documents(starts, ends - starts)


class DocumentView:
    """Some documents of a token stream, back to back, read like a 1-D array: a slice
    gathers only the pieces of the documents it touches."""

    def __init__(self, tokens, documents: Documents):
        self.tokens = tokens
        self.source_documents = documents
        self.offsets = np.concatenate([[0], np.cumsum(documents.lengths)]).astype(np.int64)
        # The same documents as positions in this view.
        self.documents = Documents(self.offsets[:-1], documents.lengths)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop = max(window.start or 0, 0), min(window.stop, len(self))
        doc = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            skip = start - int(self.offsets[doc])
            count = min(stop - start, int(self.source_documents.lengths[doc]) - skip)
            first = int(self.source_documents.starts[doc]) + skip
            pieces.append(np.asarray(self.tokens[first:first + count], np.int64))
            start, doc = start + count, doc + 1
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def stream_documents(source: WindowedStreamSource) -> Documents:
    """The documents of the stream `source` windows (a filtered view's own)."""
    if isinstance(source.tokens, DocumentView):
        return source.tokens.documents
    return documents_of(source.tokens, source.eos_id)


# --------------------------------------------------------------------------------------
# Opening the mixture (every data error surfaces here, before training starts)
# --------------------------------------------------------------------------------------

def make_mixture(cfg: DataConfig, *, vocab: int, seed: int, split: str = "train",
                 holdout_stride: int = 0) -> "MixtureSource":
    """The mixture `cfg.sources` names; DataError for a source that cannot work."""
    components, identities = [], []
    for i, spec in enumerate(cfg.sources):
        component = _open_component(i, spec, cfg, vocab=vocab,
                                    seed=seed + (i + 1) * COMPONENT_SEED_STRIDE,
                                    split=split, holdout_stride=holdout_stride)
        identities.append(_tokenizer_identity(Path(spec.path), cfg, component.eos_id))
        _check_same_tokenizer(i, spec, identities)
        components.append(component)
    return MixtureSource(components, [s.weight for s in cfg.sources], cfg, vocab=vocab,
                         seed=seed)


def _open_component(i: int, spec: SourceConfig, cfg: DataConfig, *, vocab: int, seed: int,
                    split: str, holdout_stride: int) -> WindowedStreamSource:
    key = f"data.sources[{i}]"
    path = Path(spec.path)
    try:
        tokens, eos_id = open_stream(path, cfg, vocab, key=f"{key}.path")
    except DataError as err:
        raise DataError(f"{key}.path: {err}") from None
    starts = None
    filtered = spec.min_doc_tokens > 0 or spec.max_doc_tokens is not None
    if filtered or spec.start_at_document:
        documents = _documents_of_source(path, tokens, eos_id)
        tokens = DocumentView(tokens, _kept_documents(key, spec, documents))
    if spec.start_at_document:
        starts = _document_windows(key, spec, tokens.documents, len(tokens), cfg.seq_len)
    return WindowedStreamSource(tokens, name=f"{key}.path {path}", eos_id=eos_id, cfg=cfg,
                                vocab=vocab, seed=seed, holdout_stride=holdout_stride,
                                split=split, window_starts=starts)


def _documents_of_source(path: Path, tokens, eos_id: int | None) -> Documents:
    """documents_of, kept per token file: the recipe check at load and the run both open
    the mixture, and a big file's scan should happen once."""
    if path.suffix not in (".bin", ".npy"):
        return documents_of(tokens, eos_id)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, eos_id)
    if key not in _SCANNED:
        _SCANNED[key] = documents_of(tokens, eos_id)
    return _SCANNED[key]


_SCANNED: dict[tuple, Documents] = {}


def _kept_documents(key: str, spec: SourceConfig, documents: Documents) -> Documents:
    lengths = documents.lengths
    keep = lengths >= spec.min_doc_tokens
    if spec.max_doc_tokens is not None:
        keep &= lengths <= spec.max_doc_tokens
    if not keep.any():
        bounds = f"{spec.min_doc_tokens}..{spec.max_doc_tokens or 'any'}"
        raise DataError(
            f"{key}: no document of {spec.path} is {bounds} tokens long (it has "
            f"{len(lengths)}, of {lengths.min()}..{lengths.max()} tokens); widen "
            f"{key}.min_doc_tokens / {key}.max_doc_tokens or drop the source")
    return Documents(documents.starts[keep], lengths[keep])


def _document_windows(key: str, spec: SourceConfig, documents: Documents, size: int,
                      seq_len: int) -> np.ndarray:
    """Window starts at document starts; a window must fit before the stream's end."""
    starts = documents.starts[documents.starts + seq_len + 1 <= size]
    if not len(starts):
        raise DataError(
            f"{key}.start_at_document: no document of {spec.path} starts seq_len + 1 = "
            f"{seq_len + 1} tokens before the end of its ({size} kept tokens); add data, "
            f"lower data.seq_len or set {key}.start_at_document to false")
    return starts


def _tokenizer_identity(path: Path, cfg: DataConfig, eos_id: int | None) -> dict:
    """What the source's ids mean: its tokenizer, vocabulary and end of document."""
    if path.suffix in (".bin", ".npy"):
        try:
            info = read_sidecar(path) or {}
        except TokenizerError as err:
            raise DataError(str(err)) from None
        return {"tokenizer": info.get("tokenizer"), "vocab_size": info.get("vocab_size"),
                "tokenizer_fingerprint": info.get("tokenizer_fingerprint"), "eos_id": eos_id}
    # lctrain tokenize writes the tokenizer's absolute path into a sidecar.
    return {"tokenizer": os.path.abspath(cfg.tokenizer) if cfg.tokenizer else "bytes",
            "vocab_size": None if cfg.tokenizer else BYTE_EOS + 1,
            "tokenizer_fingerprint": None, "eos_id": eos_id}


def _check_same_tokenizer(i: int, spec: SourceConfig, identities: list[dict]) -> None:
    """Every source must use the first's ids: one batch mixes them under one eos."""
    first, this = identities[0], identities[i]
    for field, value in this.items():
        known = field == "eos_id" or (value is not None and first[field] is not None)
        if known and value != first[field]:
            raise DataError(
                f"data.sources[{i}].path = '{spec.path}': its {field} {value!r} differs from "
                f"data.sources[0]'s ({first[field]!r}); a mixture needs one tokenizer: "
                f"retokenize it (lctrain tokenize) with data.sources[0]'s tokenizer or drop it")


# --------------------------------------------------------------------------------------
# The mixture
# --------------------------------------------------------------------------------------

class MixtureSource(DataSource):
    """Rows drawn from several windowed sources; see the module docstring."""

    def __init__(self, components: list[WindowedStreamSource], weights: list[float],
                 cfg: DataConfig, *, vocab: int, seed: int):
        super().__init__(cfg, vocab=vocab, seed=seed)
        self.components = components
        self.paths = [spec.path for spec in cfg.sources]
        self.weights = np.asarray(weights, np.float64) / sum(weights)
        self.cumulative = np.cumsum(self.weights)
        self.eos_id = components[0].eos_id  # the same for all (_check_same_tokenizer)
        self.last_source_ids: np.ndarray | None = None  # of the rows of the last batch read
        self._drawn_before = (0, np.zeros(len(components), np.int64))  # (index, counts)
        self._planned: tuple = (-1, None, None)  # (index, sources, numbers): see _plan

    def batch(self, index: int, rows: slice | None = None) -> Batch:
        batch = super().batch(index, rows)
        self.last_source_ids = self.source_ids(index)[rows if rows is not None else slice(None)]
        return batch

    def _window(self, index: int, row: int) -> np.ndarray:
        sources, numbers = self._plan(index)
        return self.components[sources[row]].sample(int(numbers[row]))

    def _plan(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each row of batch `index` and its sample number inside that
        source: the source's draws in earlier batches, plus the rows before it in this
        batch that drew it. Kept for the batch's other rows."""
        if self._planned[0] != index:
            sources = self.source_ids(index)
            numbers = self._counts_before(index)[sources]
            for c in range(len(self.components)):
                numbers[sources == c] += np.arange(np.count_nonzero(sources == c))
            self._planned = (index, sources, numbers)
        return self._planned[1], self._planned[2]

    def source_ids(self, index: int) -> np.ndarray:
        """The source of each row of global batch `index` (int64 [batch_size])."""
        size = self.cfg.batch_size
        return self._draw(np.arange(index * size, (index + 1) * size))

    def token_counts(self, start: int, stop: int) -> np.ndarray:
        """Input tokens each source gives batches start..stop-1 (int64 [sources])."""
        size = self.cfg.batch_size
        return self._count_draws(start * size, stop * size) * self.cfg.seq_len

    def _draw(self, samples: np.ndarray) -> np.ndarray:
        picked = np.searchsorted(self.cumulative, _uniform(self.seed, samples), side="right")
        return np.minimum(picked, len(self.components) - 1)  # cumulative[-1] may round < 1

    def _count_draws(self, first: int, stop: int) -> np.ndarray:
        counts = np.zeros(len(self.components), np.int64)
        for at in range(first, stop, COUNT_CHUNK):
            ids = self._draw(np.arange(at, min(at + COUNT_CHUNK, stop)))
            counts += np.bincount(ids, minlength=len(self.components))
        return counts

    def _counts_before(self, index: int) -> np.ndarray:
        """Draws of each source in batches 0..index-1; kept from the last call, so a run
        reading batches in order counts one batch per step (a resume counts once)."""
        cached_index, cached = self._drawn_before
        if index < cached_index:
            cached_index, cached = 0, np.zeros_like(cached)
        size = self.cfg.batch_size
        counts = cached + self._count_draws(cached_index * size, index * size)
        self._drawn_before = (index, counts)
        return counts.copy()


def _uniform(seed: int, samples: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per sample: splitmix64 of (seed, sample), vectorized."""
    base = np.uint64((seed * 0x9E3779B97F4A7C15 + MIX_SALT) % 2**64)
    z = samples.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + base
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


# --------------------------------------------------------------------------------------
# What the loop logs
# --------------------------------------------------------------------------------------

def tokens_per_source(source: MixtureSource, start: int, stop: int) -> dict[str, int]:
    """Input tokens per source (by its path) in global batches start..stop-1."""
    counts = source.token_counts(start, stop)
    return {path: int(n) for path, n in zip(source.paths, counts)}


def long_token_share(source: DataSource, threshold: int) -> float:
    """Share of the input tokens `source` trains on (over an epoch of each of its sources,
    weighted as drawn) that lie in documents longer than `threshold` tokens: how much truly
    long data the model gets."""
    if isinstance(source, MixtureSource):
        return float(sum(w * long_token_share(c, threshold)
                         for w, c in zip(source.weights, source.components)))
    if not isinstance(source, WindowedStreamSource):  # synthetic: a row is one document
        return float(source.cfg.seq_len + 1 > threshold)
    documents = stream_documents(source)
    is_long = documents.lengths > threshold
    long_before_doc = np.concatenate([[0], np.cumsum(documents.lengths * is_long)])

    def long_tokens_before(offsets: np.ndarray) -> np.ndarray:
        doc = np.searchsorted(documents.starts, offsets, side="right") - 1
        return long_before_doc[doc] + (offsets - documents.starts[doc]) * is_long[doc]

    starts = np.asarray(source.window_start(source.split_window_ids()), np.int64)
    ends = starts + source.cfg.seq_len
    return float((long_tokens_before(ends) - long_tokens_before(starts)).sum()
                 / (len(starts) * source.cfg.seq_len))
