"""A trained run written out as a Hugging Face model folder: config.json with the RoPE
the run trained with, sharded safetensors, and the run's tokenizer files.

One tensor (one layer's matrix) is gathered to the host at a time, so no process ever
holds the whole model; every process takes part in each gather and process 0 writes.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from lctrain.recipes.hf_config import check_exportable, config_json
from lctrain.recipes.schema import Recipe
from lctrain.trainer.data.provenance import (TOKENIZER_FILES, ShippedTokenizer,
                                             copy_tokenizer_files)
from lctrain.trainer.hf.convert import HFTensor, hf_shape, hf_tensors, leaf_at, to_hf
from lctrain.trainer.hf.fused import fused_tensor
from lctrain.trainer.hf.safetensors_io import INDEX_FILE, write_folder
from lctrain.trainer.hf.weights import load_weights
from lctrain.trainer.outputs.files import written_into
from lctrain.trainer.outputs.progress import Bar
from lctrain.trainer.state.build import resolved_mesh
from lctrain.trainer.state.step import build_trainable

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
NO_TOKENIZER = ShippedTokenizer(None, {}, "")


def export_owns(name: str) -> bool:
    """Whether a file of this name is one an export writes (an earlier export's, which
    --overwrite replaces); any other file in the folder is the user's and stays."""
    return (name in ("config.json", INDEX_FILE, *TOKENIZER_FILES)
            or fnmatch.fnmatch(name, "model*.safetensors"))


def export_run(recipe: Recipe, run_dir: Path, out_dir: Path, step: int | None = None,
               dtype: str = "bfloat16", console=None,
               tokenizer: ShippedTokenizer = NO_TOKENIZER) -> tuple[list[str], str]:
    """A run's checkpoint (the latest, or `step`) as a Hugging Face folder, with the
    tokenizer the CLI chose (provenance.shipped_tokenizer); returns the files written and
    which checkpoint it was. Progress goes to `console`."""
    check_exportable(recipe.model)
    recipe, mesh = resolved_mesh(recipe)
    params, origin = load_weights(recipe, build_trainable(recipe, mesh), run_dir, step,
                                  console)
    return export_hf(recipe, params, out_dir, dtype, console=console,
                     tokenizer=tokenizer), origin


def export_hf(recipe: Recipe, params: dict, out_dir: Path, dtype: str = "bfloat16",
              max_shard_bytes: int = 5 * 2**30, console=None,
              tokenizer: ShippedTokenizer = NO_TOKENIZER) -> list[str]:
    """Writes the folder's files in place of an earlier export's (the caller decided they
    may be replaced: output_files.check_target); returns the names of the files written."""
    is_main = jax.process_index() == 0
    if not is_main:  # the other processes take part in each gather and write nothing
        _write_hf(recipe, params, out_dir, dtype, max_shard_bytes, None, write=False)
        return []
    with written_into(out_dir, export_owns) as staging:
        _write_hf(recipe, params, staging, dtype, max_shard_bytes, console, write=True,
                  label=f"writing {out_dir}", tokenizer=tokenizer)
        written = sorted(path.name for path in staging.iterdir())
    return written


def _write_hf(recipe: Recipe, params: dict, folder: Path, dtype: str, max_shard_bytes: int,
              console, write: bool, label: str = "",
              tokenizer: ShippedTokenizer = NO_TOKENIZER) -> None:
    # HF name -> the parameters (and layer) it is made of: several for a fused tensor.
    located: dict[str, list[tuple[HFTensor, int | None]]] = {}
    shapes = {}
    for tensor in hf_tensors(params, recipe.model):
        leaf = leaf_at(params, tensor.path)
        for layer in (range(leaf.shape[0]) if tensor.stacked else [None]):
            located.setdefault(tensor.name(layer), []).append((tensor, layer))
            shapes[tensor.name(layer)] = hf_shape(tensor, leaf.shape[1:] if tensor.stacked
                                                  else leaf.shape)

    def ours(tensor: HFTensor, layer: int | None) -> np.ndarray:
        leaf = leaf_at(params, tensor.path)
        return _on_host(leaf if layer is None else leaf[layer])

    def values(name: str) -> np.ndarray:
        bar.advance()
        (tensor, layer), *_ = located[name]
        if tensor.part is None:
            return to_hf(tensor.layout, ours(tensor, layer))
        return fused_tensor(shapes[name], [(tensor.part, ours(tensor, layer))
                                           for tensor, layer in located[name]])

    with Bar(console, label, len(shapes)) as bar:
        write_folder(folder, list(shapes.items()), DTYPES[dtype], values, max_shard_bytes,
                     write=write)
    if not write:
        return
    if tokenizer.folder is not None:
        copy_tokenizer_files(tokenizer.folder, folder)
    config = config_json(recipe.model, recipe.data.seq_len, dtype, tokenizer.special_ids)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _on_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host: a device_get where this process holds every shard,
    else a gather over processes (every process must call it, in the same order)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
