"""`lctrain tokenize`: a corpus of .txt, .jsonl and .parquet files -> one token file + sidecar.

Documents: each .txt file is one; each line of a .jsonl file is one (its `field`); each row
of a .parquet file is one (its column `field`). Empty documents are skipped. Folders are
searched recursively, files taken in sorted order.

The corpus is cut into pieces (a .txt file, about CHUNK_BYTES of .jsonl lines, a .parquet
row group) that worker processes tokenize; the pieces are written in corpus order whatever
finishes first, so the token file is the same for any number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lctrain.trainer.data.batches import files_under, text_of
from lctrain.trainer.data.tokenizer import (DocumentTokenizer, dtype_for_vocab, sidecar_path,
                                            sidecar_text)
from lctrain.trainer.outputs.failures import DataError
from lctrain.trainer.outputs.files import replaced

SUFFIXES = (".txt", ".jsonl", ".parquet")
# Big enough that sending a piece to a worker costs little beside tokenizing it, small
# enough that one big .jsonl file still spreads over every worker.
CHUNK_BYTES = 8 << 20
# Pieces in flight per worker: keeps workers busy while the oldest is written, and bounds
# the finished pieces held in memory waiting for a slower earlier one.
IN_FLIGHT_PER_WORKER = 2


@dataclass(frozen=True)
class Piece:
    """One unit of work: .txt a whole file; .jsonl the lines in bytes [start, stop);
    .parquet row groups [start, stop)."""

    path: str
    start: int
    stop: int
    size: int  # input bytes, for progress

    @property
    def kind(self) -> str:
        return Path(self.path).suffix


# --------------------------------------------------------------------------------------
# Planning (main process; every input error shows up here or in the first pieces)
# --------------------------------------------------------------------------------------

def plan_pieces(sources: list[str], field: str, chunk_bytes: int = CHUNK_BYTES) -> list[Piece]:
    """The corpus's pieces in output order."""
    pieces: list[Piece] = []
    for path in input_files(sources):
        if path.suffix == ".jsonl":
            pieces += _jsonl_pieces(path, chunk_bytes)
        elif path.suffix == ".parquet":
            pieces += _parquet_pieces(path, field)
        else:
            pieces.append(Piece(str(path), 0, 0, path.stat().st_size))
    return pieces


def input_files(sources: list[str]) -> list[Path]:
    files = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = files_under(path, SUFFIXES)
            if not found:
                raise DataError(f"{path}: folder has no {', '.join(SUFFIXES)} files (searched "
                                f"recursively); add some or give other sources")
            files += found
        elif not path.exists():
            raise DataError(f"{path}: no such file or folder; give {', '.join(SUFFIXES)} files "
                            f"or folders of them")
        elif path.suffix not in SUFFIXES:
            raise DataError(f"{path}: unknown suffix '{path.suffix}'; give "
                            f"{', '.join(SUFFIXES)} files (rename it if it is one of those)")
        else:
            files.append(path)
    return files


def _jsonl_pieces(path: Path, chunk_bytes: int) -> list[Piece]:
    """Byte ranges of about chunk_bytes that start and end at line boundaries."""
    size = path.stat().st_size
    cuts = [0]
    with path.open("rb") as file:
        while cuts[-1] + chunk_bytes < size:
            file.seek(cuts[-1] + chunk_bytes)
            file.readline()  # to the end of the line the target offset falls in
            cuts.append(file.tell())
    if cuts[-1] < size:
        cuts.append(size)
    return [Piece(str(path), start, stop, stop - start) for start, stop in zip(cuts, cuts[1:])]


def _parquet_pieces(path: Path, field: str) -> list[Piece]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({err}); rewrite it") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise DataError(f"{path}: no column '{field}' (columns: {', '.join(schema.names)}); "
                        f"pick the text column with --field")
    if not (pa.types.is_string(schema.field(field).type)
            or pa.types.is_large_string(schema.field(field).type)):
        raise DataError(f"{path}: column '{field}' holds {schema.field(field).type}, not "
                        f"text; pick the text column with --field")
    return [Piece(str(path), group, group + 1, parquet.metadata.row_group(group).total_byte_size)
            for group in range(parquet.num_row_groups)]


# --------------------------------------------------------------------------------------
# Reading and encoding one piece (in a worker)
# --------------------------------------------------------------------------------------

def read_documents(piece: Piece, field: str) -> list[str]:
    """The piece's non-empty documents, in order."""
    if piece.kind == ".jsonl":
        texts = _jsonl_documents(piece, field)
    elif piece.kind == ".parquet":
        table = pq.ParquetFile(piece.path).read_row_groups(range(piece.start, piece.stop),
                                                           columns=[field])
        texts = table.column(field).to_pylist()
    else:
        texts = [text_of(Path(piece.path).read_bytes())]
    return [text for text in texts if text]  # None (a parquet null) or "" is no document


def _jsonl_documents(piece: Piece, field: str) -> list[str]:
    with open(piece.path, "rb") as file:
        file.seek(piece.start)
        lines = file.read(piece.stop - piece.start).split(b"\n")
    texts = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{_line_name(piece, index)}: not valid JSON ({err.msg}); fix the "
                            f"line or remove it") from None
        if not isinstance(record, dict) or field not in record:
            raise DataError(f"{_line_name(piece, index)}: no field '{field}'; pick the text "
                            f"field with --field")
        if not isinstance(record[field], (str, type(None))):
            raise DataError(f"{_line_name(piece, index)}: field '{field}' holds "
                            f"{type(record[field]).__name__}, not text; pick the text field "
                            f"with --field")
        texts.append(record[field])
    return texts


def _line_name(piece: Piece, index: int) -> str:
    """'file.jsonl line N', counted from the top of the file (only for error messages)."""
    with open(piece.path, "rb") as file:
        lines_before = file.read(piece.start).count(b"\n")
    return f"{piece.path} line {lines_before + index + 1}"


@dataclass(frozen=True)
class PieceEncoder:
    tokenizer: DocumentTokenizer
    field: str
    dtype: str

    def __call__(self, piece: Piece) -> tuple[np.ndarray, int]:
        """The piece's tokens, each document ending with the eos id, and its document count."""
        documents = self.tokenizer.encode_documents(read_documents(piece, self.field))
        ids = [token for document in documents for token in document]
        return np.asarray(ids, dtype=self.dtype), len(documents)


_worker_encoder: PieceEncoder | None = None  # one per worker process, built once


def _start_worker(tokenizer_path: str, field: str, dtype: str) -> None:
    global _worker_encoder
    # The workers are the parallelism: tokenizers' own thread pool in each would only
    # oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = PieceEncoder(DocumentTokenizer.load(tokenizer_path), field, dtype)


def _encode_in_worker(piece: Piece) -> tuple[np.ndarray, int]:
    return _worker_encoder(piece)


# --------------------------------------------------------------------------------------
# The whole corpus
# --------------------------------------------------------------------------------------

def tokenize_corpus(pieces: list[Piece], tokenizer: DocumentTokenizer, out: str | os.PathLike,
                    *, field: str = "text", workers: int = 1,
                    on_piece: Callable[[Piece, int], None] = lambda piece, documents: None
                    ) -> dict[str, Any]:
    """Writes the pieces' tokens to `out` and the sidecar beside it; returns the sidecar.
    `on_piece(piece, documents)` is called as each piece is written."""
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    encoder = PieceEncoder(tokenizer, field, dtype)
    out = Path(out)
    documents = tokens = 0
    # Both files are written beside their targets and renamed when complete: never half a
    # file. The old sidecar goes first; a crash between the renames leaves a token file
    # without a sidecar, never new tokens under the old sidecar (whose token count would
    # not match the file: token_file_settings refuses that too).
    side = out.with_name(f".{out.name}.json.partial-{os.getpid()}")
    try:
        with replaced(out) as partial:
            with partial.open("wb") as file:
                for piece, (ids, count) in zip(pieces,
                                               _encode_in_order(pieces, encoder, workers)):
                    ids.tofile(file)
                    documents, tokens = documents + count, tokens + len(ids)
                    on_piece(piece, count)
            if documents == 0:
                raise DataError(f"{out}: nothing to write, every input document is empty; "
                                f"check the sources (and --field)")
            info = dict(tokenizer=tokenizer.path, tokenizer_fingerprint=tokenizer.fingerprint,
                        eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id,
                        vocab_size=tokenizer.vocab_size, dtype=dtype, documents=documents,
                        tokens=tokens)
            side.write_text(sidecar_text(info))
            sidecar_path(out).unlink(missing_ok=True)
    except BaseException:
        side.unlink(missing_ok=True)
        raise
    os.replace(side, sidecar_path(out))
    return info


def _encode_in_order(pieces: list[Piece], encoder: PieceEncoder,
                     workers: int) -> Iterator[tuple[np.ndarray, int]]:
    if workers <= 1 or len(pieces) <= 1:
        yield from map(encoder, pieces)
        return
    # spawn, not fork: the caller may have started threads (jax, tokenizers' pool), which a
    # forked child would inherit half-way through.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_start_worker,
                             initargs=(encoder.tokenizer.path, encoder.field,
                                       encoder.dtype)) as pool:
        waiting = iter(pieces)
        in_flight: deque[Future] = deque(
            pool.submit(_encode_in_worker, piece)
            for piece in islice(waiting, IN_FLIGHT_PER_WORKER * workers))
        try:
            while in_flight:
                result = in_flight.popleft().result()
                for piece in islice(waiting, 1):
                    in_flight.append(pool.submit(_encode_in_worker, piece))
                yield result
        finally:
            for future in in_flight:  # after an error: don't finish work nobody will write
                future.cancel()
