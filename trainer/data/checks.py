"""The recipe's data checked before anything compiles: each file it names exists and suits
the model (its tokenizer, sidecar, vocabulary and, for an imported model, the model's own
tokenizer), and a mixture opens. Part of phase 2 of a recipe's checks (trainer/train/
preflight.py; `lctrain eval` calls it itself, `lctrain export` needs no data): phase 1,
recipes.load_recipe, checked what the recipe says on its own. Errors are RecipeErrors
naming the key. No jax here.
"""

from __future__ import annotations

import math
from pathlib import Path

from lctrain.recipes.schema import DataConfig, Recipe, RecipeError, require
from lctrain.trainer.data.sources import make_source
from lctrain.trainer.data.tokenizer import (DocumentTokenizer, TokenizerError,
                                            check_model_tokenizer, token_file_settings)
from lctrain.trainer.outputs.failures import DataError


def check_data(recipe: Recipe) -> Recipe:
    """Checks data.source (or data.sources) and eval.source; returns the recipe."""
    if recipe.data.sources:
        _validate_mixture(recipe)
    else:
        _validate_source(recipe)
    if recipe.eval.source is not None:
        _validate_source(recipe.for_evaluation(), "eval")
    return recipe


def _validate_source(recipe: Recipe, key: str = "data") -> None:
    """data.source (or, with key 'eval', eval.source and eval.seq_len: what evaluation
    reads) exists and suits the model."""
    d = recipe.data
    if d.source == "synthetic":
        require(d.seq_len >= 4, f"{key}.seq_len", d.seq_len, "the synthetic task needs >= 4")
        if key == "data":  # evaluation may well read synthetic data beside a tokenizer
            _require_no_tokenizer(d)
        return
    require(Path(d.source).exists(), f"{key}.source", d.source,
             f"no such file or folder (looked for {Path(d.source).absolute()}: a relative path "
             f"is taken from the working directory); use 'synthetic', a .bin/.npy token file "
             f"or text file(s)")
    try:
        if Path(d.source).suffix in (".bin", ".npy"):
            if key == "data":
                _require_no_tokenizer(d)
            token_file_settings(d.source, eos_id=d.eos_id, token_dtype=d.token_dtype,
                                model_vocab=recipe.model.vocab, key=key,
                                model_dir=recipe.model.hf_dir)
        elif d.tokenizer is not None:
            DocumentTokenizer.load(d.tokenizer, key="data.tokenizer").check_vocab(
                recipe.model.vocab, key="data.tokenizer", model_dir=recipe.model.hf_dir)
        else:
            require(recipe.model.vocab >= 257, "model.vocab", recipe.model.vocab,
                     "text sources use the byte tokenizer (256 bytes + end-of-document): "
                     "need >= 257, or set data.tokenizer")
        if recipe.model.hf_dir is not None:
            check_model_tokenizer(recipe.model.hf_dir, d, key)
    except TokenizerError as err:
        raise RecipeError(str(err)) from None


def _validate_mixture(recipe: Recipe) -> None:
    """data.sources: each source exists, the weights are shares, and the mixture opens
    (no source left empty by its length filter, one tokenizer for all)."""
    d = recipe.data
    require(d.source == "synthetic", "data.source", d.source,
             "data.sources is set too, and a recipe reads one or the other: remove "
             "data.source (or add it to data.sources as another {path, weight})")
    for i, spec in enumerate(d.sources):
        key = f"data.sources[{i}]"
        require(spec.path != "" and Path(spec.path).exists(), f"{key}.path", spec.path,
                 f"no such file or folder (looked for {Path(spec.path).absolute()}); use a "
                 f".bin/.npy token file (lctrain tokenize) or text file(s)")
        require(math.isfinite(spec.weight) and spec.weight >= 0, f"{key}.weight", spec.weight,
                 "must be a number >= 0 (its share of training tokens, before the weights "
                 "are divided by their sum)")
        require(spec.min_doc_tokens >= 0, f"{key}.min_doc_tokens", spec.min_doc_tokens,
                 "must be >= 0 (0 keeps documents of any length)")
        require(spec.max_doc_tokens is None or spec.max_doc_tokens >= max(spec.min_doc_tokens, 1),
                 f"{key}.max_doc_tokens", spec.max_doc_tokens,
                 f"must be >= {key}.min_doc_tokens ({spec.min_doc_tokens}) and >= 1, or null")
    weights = [spec.weight for spec in d.sources]
    require(sum(weights) > 0, "data.sources", weights,
             "the weights must add up to a positive number: give a source a weight > 0")
    try:
        make_source(d, vocab=recipe.model.vocab, seed=recipe.train.seed,
                    holdout=recipe.eval.data_holdout)
        if recipe.model.hf_dir is not None:  # make_source checked that the sources agree
            check_model_tokenizer(recipe.model.hf_dir, d)
    except (DataError, TokenizerError) as err:
        raise RecipeError(str(err)) from None


def _require_no_tokenizer(d: DataConfig) -> None:
    require(d.tokenizer is None, "data.tokenizer", d.tokenizer,
             "only used with a text data.source (a token file's sidecar <file>.json names "
             "its tokenizer); set it to null")
