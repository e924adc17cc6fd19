"""Hugging Face tokenizers, and the sidecar JSON that says how a token file was made.

A tokenizer is a Hugging Face model folder (tokenizer.json, usually tokenizer_config.json
beside it) or a tokenizer.json file, loaded with the Rust `tokenizers` library: the same
file every HF model ships, without transformers or torch.

Special tokens follow the tokenizer's own config:

* BOS: encoding with add_special_tokens=True applies tokenizer.json's post-processor (Llama 3
  adds <|begin_of_text|>); `add_bos_token: true` in tokenizer_config.json adds the bos_token
  where the post-processor does not.
* EOS: every document ends with the eos_token of tokenizer_config.json (appended unless the
  encoding already ends with it). That is the document separator of pretraining data: for a
  Llama 3 base model it is <|end_of_text|> (128001). An instruct model's config names
  <|eot_id|> (128009), the end of a chat turn; to pretrain on plain documents with it, use
  the base model's tokenizer or edit eos_token. With no eos_token there is no separator,
  and loading fails rather than guess one.

A token file `X.bin` written by `lctrain tokenize` has a sidecar `X.bin.json` with the
tokenizer, eos_id, bos_id, vocab_size, dtype, documents and tokens, so that training never
guesses the end-of-document id or the element type.

No jax here: the recipe loader checks tokenizers and sidecars before anything compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from lctrain.trainer.outputs.failures import DataError

UINT16_VOCAB = 1 << 16  # ids 0..65535 fit in uint16
ITEMSIZES = {"uint16": 2, "uint32": 4}  # token-file element types, in bytes


class TokenizerError(DataError):
    """A tokenizer or sidecar that cannot be used; the message names the file, the value and
    the fix (the recipe loader and the data pipeline re-raise it as their own error)."""


@dataclass(frozen=True)
class DocumentTokenizer:
    """Turns documents into token ids, each ending with the end-of-document id."""

    path: str  # absolute, as given: a model folder or a tokenizer.json file
    tokenizer: Tokenizer
    eos_id: int
    bos_id: int | None
    add_bos: bool  # tokenizer_config.json's add_bos_token

    @property
    def fingerprint(self) -> str:
        """A hash of everything that maps text to ids (normalizer, pre-tokenizer, vocabulary,
        merges, added tokens) and of the end-of-document id: equal for two copies of one
        tokenizer, different for another tokenizer of the same vocabulary size."""
        canonical = json.dumps(json.loads(self.tokenizer.to_str()), sort_keys=True)
        return hashlib.sha256(f"{canonical}\neos {self.eos_id}".encode()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def load(cls, path: str | os.PathLike, key: str = "tokenizer") -> DocumentTokenizer:
        """`key` is what the user set (data.tokenizer, --tokenizer), for the messages."""
        tokenizer_file = _tokenizer_file(Path(path), key)
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust side raises a plain Exception
            raise TokenizerError(
                f"{key} {tokenizer_file}: not a readable tokenizer.json ({err}); re-save it "
                f"with tokenizer.save() or point {key} at another tokenizer") from None
        config_file = tokenizer_file.parent / "tokenizer_config.json"
        config = _read_json(config_file, f"{key} {config_file}") if config_file.is_file() else {}
        eos_id = _special_id(tokenizer, config, "eos_token", config_file, key)
        if eos_id is None:
            raise TokenizerError(
                f"{key} {config_file}: no eos_token, so documents cannot be separated; add "
                f"\"eos_token\": \"<end-of-document token>\" to tokenizer_config.json")
        return cls(path=os.path.abspath(path), tokenizer=tokenizer, eos_id=eos_id,
                   bos_id=_special_id(tokenizer, config, "bos_token", config_file, key),
                   add_bos=bool(config.get("add_bos_token", False)))

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text as one document: special tokens, then the eos id."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        return [self._as_document(encoding.ids) for encoding in encodings]

    def _as_document(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        # add_eos_token needs no case of its own: every document gets the eos exactly once.
        return ids if ids[-1:] == [self.eos_id] else [*ids, self.eos_id]

    def check_vocab(self, model_vocab: int, key: str, model_dir: str | None = None) -> None:
        check_vocab(self.vocab_size, model_vocab, f"{key} {self.path}", model_dir)


def _tokenizer_file(path: Path, key: str) -> Path:
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{key} {path}: no such file; give a Hugging Face model folder with a "
            f"tokenizer.json, or a tokenizer.json file")
    return path


def _special_id(tokenizer: Tokenizer, config: dict[str, Any], name: str, config_file: Path,
                key: str) -> int | None:
    token = config.get(name)
    if isinstance(token, dict):  # an AddedToken saved whole: {"content": "</s>", ...}
        token = token.get("content")
    if not isinstance(token, str):
        return None
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise TokenizerError(
            f"{key} {config_file}: {name} {token!r} is not in the tokenizer's vocabulary; set "
            f"{name} to one of its special tokens")
    return token_id


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"{what}: not valid JSON ({err}); fix or regenerate it") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{what}: must hold a JSON object, got {type(value).__name__}; "
                             f"fix or regenerate it")
    return value


def check_vocab(vocab_size: int, model_vocab: int, what: str,
                model_dir: str | None = None) -> None:
    """Every id the tokenizer can emit needs a row in the model's embedding. An imported
    model's vocabulary is its config.json's (model_dir), so the fix there is the tokenizer."""
    if vocab_size <= model_vocab:
        return
    fix = (f"tokenize with model.init's own tokenizer (--tokenizer {model_dir}): an imported "
           f"model's vocabulary is its config.json's vocab_size" if model_dir else
           f"set model.vocab to at least {vocab_size} or use the model's own tokenizer")
    raise TokenizerError(f"{what}: tokenizer vocabulary {vocab_size} exceeds model.vocab "
                         f"{model_vocab}; {fix}")


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest token-file element type that holds every id."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


# --------------------------------------------------------------------------------------
# Sidecars
# --------------------------------------------------------------------------------------

def sidecar_path(token_file: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(token_file)}.json")


def write_sidecar(token_file: str | os.PathLike, info: dict[str, Any]) -> None:
    sidecar_path(token_file).write_text(sidecar_text(info))


def sidecar_text(info: dict[str, Any]) -> str:
    return json.dumps(info, indent=2) + "\n"


def read_sidecar(token_file: str | os.PathLike) -> dict[str, Any] | None:
    """The sidecar of `token_file`, or None when it has none."""
    path = sidecar_path(token_file)
    if not path.is_file():
        return None
    info = _read_json(path, f"data.source sidecar {path}")
    for name in ("eos_id", "vocab_size"):
        if not isinstance(info.get(name), (int, type(None))) or isinstance(info.get(name), bool):
            raise TokenizerError(f"data.source sidecar {path}: {name} = {info.get(name)!r} is "
                                 f"not an integer; regenerate it with lctrain tokenize")
    if info.get("dtype") not in ("uint16", "uint32", None):
        raise TokenizerError(f"data.source sidecar {path}: dtype = {info.get('dtype')!r}; "
                             f"expected uint16 or uint32; regenerate it with lctrain tokenize")
    return info


def token_file_settings(token_file: str | os.PathLike, *, eos_id: int | None,
                        token_dtype: str | None, model_vocab: int, key: str = "data",
                        model_dir: str | None = None) -> tuple[int | None, str]:
    """(eos id, element type) of a token file: its sidecar's when it has one, where a recipe
    value must agree; else the recipe's (dtype uint16 when unset). `key` is the section
    whose source it is (data or eval), `model_dir` model.init's folder, for the messages."""
    info = read_sidecar(token_file)
    if info is None:
        return eos_id, token_dtype or "uint16"
    where = f"sidecar {sidecar_path(token_file)}"
    _agree("data.eos_id", eos_id, info.get("eos_id"), where)
    _agree("data.token_dtype", token_dtype, info.get("dtype"), where)
    _check_token_count(Path(token_file), info, where)
    if info.get("vocab_size") is not None:
        check_vocab(info["vocab_size"], model_vocab, f"{key}.source {os.fspath(token_file)}",
                    model_dir)
    return info.get("eos_id"), info.get("dtype") or token_dtype or "uint16"


def _check_token_count(token_file: Path, info: dict[str, Any], where: str) -> None:
    """A .bin file holds exactly the sidecar's tokens: else one of the two was replaced
    without the other, and the sidecar's eos id and dtype may not be the file's."""
    tokens, itemsize = info.get("tokens"), ITEMSIZES.get(info.get("dtype"))
    if token_file.suffix != ".bin" or not isinstance(tokens, int) or itemsize is None:
        return
    size = token_file.stat().st_size
    if size != tokens * itemsize:
        raise TokenizerError(
            f"data.source {token_file}: {size:,} bytes, but the {where} describes {tokens:,} "
            f"{info['dtype']} tokens ({tokens * itemsize:,} bytes): the file and its sidecar "
            f"come from different runs of lctrain tokenize; tokenize again")


def _agree(key: str, recipe_value: Any, sidecar_value: Any, where: str) -> None:
    if recipe_value is not None and sidecar_value is not None and recipe_value != sidecar_value:
        raise TokenizerError(
            f"recipe key '{key}' = {recipe_value!r} disagrees with {where} ({sidecar_value!r}); "
            f"leave {key} unset (the sidecar's is used) or make it equal")


def data_fingerprint(data) -> tuple[str, str] | None:
    """(fingerprint, where it comes from) of the tokenizer `data` was or will be tokenized
    with: the token file's sidecar's, else its tokenizer's (an older sidecar has none), else
    data.tokenizer's; None for synthetic data, the byte tokenizer and bare token files."""
    token_file = data.sources[0].path if data.sources else data.source
    info = (read_sidecar(token_file) or {}) if Path(token_file).suffix in (".bin", ".npy") else {}
    if info.get("tokenizer_fingerprint"):
        return info["tokenizer_fingerprint"], f"{token_file} (tokenized with {info['tokenizer']})"
    path = tokenizer_path(data)
    if path is None or not Path(path).exists():
        return None
    return DocumentTokenizer.load(path).fingerprint, str(path)


def check_model_tokenizer(model_dir: str, data, key: str = "data") -> None:
    """The data's tokenizer is model.init's folder's (when the folder has one), unless
    data.other_tokenizer says a different one is intended."""
    if data.other_tokenizer or not (Path(model_dir) / "tokenizer.json").is_file():
        return
    found = data_fingerprint(data)
    model = DocumentTokenizer.load(model_dir, key="model.init")
    if found is None or found[0] == model.fingerprint:
        return
    fingerprint, where = found
    raise TokenizerError(
        f"{key}.source {where} has tokenizer fingerprint {fingerprint}, but model.init's "
        f"folder {model_dir} has tokenizer {model.fingerprint}: the ids would mean other text "
        f"to the model; tokenize with --tokenizer {model_dir}, or set "
        f"data.other_tokenizer=true if the other tokenizer is intended")


def data_tokenizer(data) -> DocumentTokenizer | None:
    """The tokenizer `data` (a recipe's DataConfig) was made with: data.tokenizer, else its
    token file's sidecar's (a mixture's first source's: the loader checked that they agree);
    None for synthetic data and the byte tokenizer."""
    path = tokenizer_path(data)
    return DocumentTokenizer.load(path) if path else None


def tokenizer_path(data) -> str | None:
    """Where data_tokenizer's tokenizer is (a folder or a tokenizer.json), without loading it."""
    token_file = data.sources[0].path if data.sources else data.source
    if data.tokenizer is None and Path(token_file).suffix in (".bin", ".npy"):
        return (read_sidecar(token_file) or {}).get("tokenizer")
    return data.tokenizer
