"""`lctrain tokenize`: text corpora into a token file for `data.source` (the work is in
trainer/data/corpus.py and trainer/data/tokenizer.py). Imports neither jax nor the model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from lctrain.trainer.data.corpus import SUFFIXES, plan_pieces, tokenize_corpus
from lctrain.trainer.data.tokenizer import DocumentTokenizer, TokenizerError, sidecar_path
from lctrain.trainer.outputs.failures import DataError
from lctrain.trainer.outputs.files import OutputError, check_target

from .common import app, console, error_console, fail


@app.command()
def tokenize(
    sources: list[str] = typer.Argument(
        ..., help=f"{', '.join(SUFFIXES)} files or folders (searched recursively). A .txt file "
                  f"is one document, a .jsonl line one, a .parquet row one."),
    tokenizer: str = typer.Option(
        ..., help="Hugging Face model folder (tokenizer.json + tokenizer_config.json) or a "
                  "tokenizer.json file; documents end with its config's eos_token."),
    out: Path = typer.Option(..., help="Token file to write (.bin); the sidecar goes to OUT.json."),
    field: str = typer.Option("text", help="The text field of .jsonl lines / column of .parquet."),
    workers: Optional[int] = typer.Option(None, help="Processes (default: the CPU count)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace OUT (and its sidecar) when it exists."),
) -> None:
    """Tokenize text into a raw token file (uint16, or uint32 past 65,536 ids) and a sidecar
    JSON that names the tokenizer (with a fingerprint) and gives training its eos id and
    dtype."""
    workers = workers if workers is not None else os.cpu_count() or 1
    if workers < 1:
        fail(f"--workers {workers}: must be at least 1")
    if out.suffix != ".bin":
        fail(f"--out {out}: must end with .bin (data.source reads raw tokens "
             f"from .bin files)")
    try:
        for target in (out, sidecar_path(out)):
            check_target(target, overwrite, "--out")
        loaded = DocumentTokenizer.load(tokenizer, key="--tokenizer")
        pieces = plan_pieces(sources, field)
        out.parent.mkdir(parents=True, exist_ok=True)
        with _progress() as progress:
            bar = progress.add_task("tokenizing", total=sum(piece.size for piece in pieces))
            info = tokenize_corpus(pieces, loaded, out, field=field, workers=workers,
                                   on_piece=lambda piece, _: progress.advance(bar, piece.size))
    except (DataError, TokenizerError, OutputError) as err:
        fail(str(err))
    console.print(f"{escape(str(out))}: {info['documents']:,} documents, {info['tokens']:,} "
                  f"tokens ({info['dtype']}, eos_id {info['eos_id']}); sidecar "
                  f"{escape(str(out))}.json", highlight=False, soft_wrap=True)


def _progress() -> Progress:
    """Input bytes read, on stderr so that stdout keeps only the summary."""
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=error_console)
