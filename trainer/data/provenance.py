"""Which tokenizer a run trained with, kept in its run dir: `provenance.json` (the
tokenizer's fingerprint, where it was copied from, its eos and bos ids, the data files) and
a copy of its files in `tokenizer/`, written when a run starts in a fresh run dir.

A token file names its tokenizer by path (its sidecar), and the path outlives the
tokenizer: re-tokenizing with another tokenizer of the same vocabulary size, or moving the
folder, would otherwise go unnoticed. So `eval` and `export` compare what they read with
the record, a resumed run too, and `export` ships the copy. No jax here: the CLI checks
before jax starts.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lctrain.recipes.schema import Recipe, RecipeError
from lctrain.trainer.data.tokenizer import (DocumentTokenizer, TokenizerError, data_fingerprint,
                                            read_sidecar, tokenizer_path)

RECORD_FILE = "provenance.json"
TOKENIZER_COPY = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class TokenizerRecord:
    """What a run dir's provenance.json says; fingerprint None for a run that read no
    tokenizer's ids (synthetic data, the byte tokenizer, token files without a sidecar)."""

    fingerprint: str | None
    copied_from: str | None
    eos_id: int | None
    bos_id: int | None
    data: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        return {"tokenizer_fingerprint": self.fingerprint, "tokenizer_copied_from":
                self.copied_from, "eos_id": self.eos_id, "bos_id": self.bos_id,
                "data": list(self.data)}

    def special_ids(self) -> dict[str, int]:
        return known_ids(self.eos_id, self.bos_id)


def known_ids(eos_id: int | None, bos_id: int | None) -> dict[str, int]:
    """config.json's eos_token_id and bos_token_id, those known."""
    ids = {"eos_token_id": eos_id, "bos_token_id": bos_id}
    return {key: value for key, value in ids.items() if value is not None}


def read_record(run_dir: Path) -> TokenizerRecord | None:
    """The run dir's record; None for a run dir that has none (new, or written before
    lctrain kept one)."""
    path = Path(run_dir) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        return TokenizerRecord(raw["tokenizer_fingerprint"], raw["tokenizer_copied_from"],
                               raw["eos_id"], raw["bos_id"], tuple(raw["data"]))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise RecipeError(f"{path}: unreadable ({err!r}); it is written when a run starts: "
                          f"restore it, or train in a new run dir") from None


# --------------------------------------------------------------------------------------
# Recording, when a run starts
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedRecord:
    """What a run about to start in a fresh run dir will record, found before it compiles."""

    record: TokenizerRecord
    tokenizer: DocumentTokenizer | None  # whose files are copied


def plan_record(recipe: Recipe) -> PlannedRecord:
    """The tokenizer recipe.data was tokenized with, loaded and checked against the token
    file's sidecar: RecipeError, one line, when it is gone or another one now."""
    data = recipe.data
    paths = tuple(spec.path for spec in data.sources) or (data.source,)
    tokenizer = _recorded_tokenizer(recipe, data_fingerprint(data))
    if tokenizer is None:
        eos_id, bos_id = _bare_special_ids(recipe)
        return PlannedRecord(TokenizerRecord(None, None, eos_id, bos_id, paths), None)
    return PlannedRecord(TokenizerRecord(tokenizer.fingerprint, tokenizer.path,
                                         tokenizer.eos_id, tokenizer.bos_id, paths), tokenizer)


def _recorded_tokenizer(recipe: Recipe, found: tuple[str, str] | None
                        ) -> DocumentTokenizer | None:
    """The tokenizer to copy: the one the data names, else model.init's folder's when it is
    the same tokenizer (the folder a sidecar named may be on another machine)."""
    path = tokenizer_path(recipe.data)
    if path is None or found is None:
        return None
    fingerprint, where = found
    candidates = [path] + ([recipe.model.hf_dir] if recipe.model.hf_dir else [])
    for candidate in candidates:
        if (Path(candidate) / "tokenizer.json").is_file() or Path(candidate).is_file():
            loaded = _load(candidate, "data.source's tokenizer")
            if loaded.fingerprint == fingerprint:
                return loaded
    raise RecipeError(
        f"data.source {where}: that tokenizer ({fingerprint}) is no longer at {path}"
        f"{' nor in model.init' if recipe.model.hf_dir else ''} (moved or replaced), and the "
        f"run dir keeps a copy of the tokenizer it trains with; put it back at {path}, or "
        f"tokenize again with --tokenizer <its new folder>")


def _bare_special_ids(recipe: Recipe) -> tuple[int | None, int | None]:
    """eos and bos of data without a tokenizer: a sidecar's, else the recipe's eos."""
    first = recipe.data.sources[0].path if recipe.data.sources else recipe.data.source
    info = (read_sidecar(first) or {}) if Path(first).suffix in (".bin", ".npy") else {}
    return info.get("eos_id", recipe.data.eos_id), info.get("bos_id")


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    """The files of the tokenizer in folder `source` that a model folder ships."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)


def write_record(run_dir: Path, planned: PlannedRecord) -> None:
    """provenance.json and the tokenizer's files in run_dir, replacing an earlier record
    (a start that never trained leaves one; a resume does not call this)."""
    copy = Path(run_dir) / TOKENIZER_COPY
    if copy.exists():
        shutil.rmtree(copy)
    if planned.tokenizer is not None:
        copy.mkdir(parents=True)
        source = Path(planned.tokenizer.path)
        copy_tokenizer_files(source if source.is_dir() else source.parent, copy)
    (Path(run_dir) / RECORD_FILE).write_text(
        json.dumps(planned.record.as_json(), indent=2) + "\n")


# --------------------------------------------------------------------------------------
# Comparing, when a run resumes and in eval and export
# --------------------------------------------------------------------------------------

def check_against_record(data, run_dir: Path, key: str) -> None:
    """RecipeError naming both tokenizers when `data` (a DataConfig; `key` its section:
    data or eval) was tokenized with another tokenizer than the run in run_dir trained
    with. Data of unknown tokenizer (synthetic, bare token files) passes."""
    record = read_record(run_dir)
    if record is None or record.fingerprint is None:
        return
    try:
        found = data_fingerprint(data)
    except TokenizerError as err:
        raise RecipeError(str(err)) from None
    if found is None or found[0] == record.fingerprint:
        return
    fingerprint, where = found
    copy = Path(run_dir) / TOKENIZER_COPY
    raise RecipeError(
        f"{key}.source {where} has tokenizer fingerprint {fingerprint}, but run dir {run_dir} "
        f"trained with tokenizer {record.fingerprint} (copied from {record.copied_from} to "
        f"{copy}): the ids would mean other text to the model; tokenize it again with "
        f"--tokenizer {copy}")


# --------------------------------------------------------------------------------------
# The tokenizer an export ships
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShippedTokenizer:
    """The tokenizer files an export copies (folder None: none) and config.json's ids."""

    folder: Path | None
    special_ids: dict[str, int]
    origin: str  # where the files come from, for the summary line


def run_init_folder(run_dir: Path) -> str | None:
    """model.init's folder (hf:<dir>) of the run in run_dir: its recipe.yaml says, where
    load_run_recipe rebuilds the model without it."""
    path = Path(run_dir) / "recipe.yaml"
    raw = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    init = str((raw.get("model") or {}).get("init", "random"))
    return init.removeprefix("hf:") if init.startswith("hf:") else None


def shipped_tokenizer(run_dir: Path, no_tokenizer: bool) -> ShippedTokenizer:
    """The run's recorded tokenizer, else model.init's folder's, else none where the run
    recorded that it read no tokenizer or --no-tokenizer says so; RecipeError otherwise.
    config.json's ids are known even when no files are shipped."""
    found = _available_tokenizer(run_dir, no_tokenizer)
    if no_tokenizer:
        return ShippedTokenizer(None, found.special_ids if found else {}, "")
    return found


def _available_tokenizer(run_dir: Path, no_tokenizer: bool) -> ShippedTokenizer | None:
    record = read_record(run_dir)
    model_dir = run_init_folder(run_dir)
    if record is not None and record.fingerprint is not None:
        return _recorded_copy(run_dir, record)
    if model_dir and (Path(model_dir) / "tokenizer.json").is_file():
        loaded = _load(model_dir, "model.init")
        return ShippedTokenizer(Path(model_dir), known_ids(loaded.eos_id, loaded.bos_id),
                                f"model.init's folder {model_dir}")
    if record is not None:  # the run read no tokenizer's ids: there is none to ship
        return ShippedTokenizer(None, record.special_ids(), "")
    if no_tokenizer:
        return None
    raise RecipeError(
        f"run dir {run_dir} records no tokenizer (its run began before lctrain kept one) "
        f"and model.init's folder has none: the export would not say how to turn text "
        f"into its ids; give --no-tokenizer to export the weights alone")


def _recorded_copy(run_dir: Path, record: TokenizerRecord) -> ShippedTokenizer:
    copy = Path(run_dir) / TOKENIZER_COPY
    if not (copy / "tokenizer.json").is_file():
        raise RecipeError(
            f"{copy}: missing, but {Path(run_dir) / RECORD_FILE} says the run trained with "
            f"tokenizer {record.fingerprint} (copied from {record.copied_from}); restore the "
            f"folder, or give --no-tokenizer to export the weights alone")
    loaded = _load(copy, "the run dir's tokenizer")
    if loaded.fingerprint != record.fingerprint:
        raise RecipeError(
            f"{copy}: tokenizer {loaded.fingerprint}, but {Path(run_dir) / RECORD_FILE} says "
            f"the run trained with {record.fingerprint}: the copy was changed; restore it "
            f"from {record.copied_from}, or give --no-tokenizer")
    return ShippedTokenizer(copy, record.special_ids(),
                            f"the run's tokenizer (copied from {record.copied_from})")


def _load(folder: str | Path, key: str) -> DocumentTokenizer:
    try:
        return DocumentTokenizer.load(folder, key=key)
    except TokenizerError as err:
        raise RecipeError(str(err)) from None
