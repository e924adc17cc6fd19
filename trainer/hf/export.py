"""A trained run written out as a Hugging Face model folder: config.json with the RoPE
the run trained with, sharded safetensors, and the run's tokenizer files.

One tensor (one layer's matrix) is gathered to the host at a time, so no process ever
holds the whole model; every process takes part in each gather and process 0 writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from lctrain.recipes.hf_config import check_exportable, config_json
from lctrain.recipes.schema import Recipe
from lctrain.trainer.data.tokenizer import DocumentTokenizer, data_tokenizer
from lctrain.trainer.hf.convert import HFTensor, hf_shape, hf_tensors, leaf_at, to_hf
from lctrain.trainer.hf.fused import fused_tensor
from lctrain.trainer.hf.safetensors_io import write_folder
from lctrain.trainer.hf.weights import load_weights
from lctrain.trainer.outputs.files import replaced
from lctrain.trainer.outputs.progress import Bar
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import build_trainable

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_run(recipe: Recipe, run_dir: Path, out_dir: Path, step: int | None = None,
               dtype: str = "bfloat16", console=None) -> tuple[list[str], str]:
    """A run's checkpoint (the latest, or `step`) as a Hugging Face folder; returns the
    files written and which checkpoint it was. Progress goes to `console`."""
    check_exportable(recipe.model)
    mesh = mesh_for(recipe)
    params, origin = load_weights(recipe, build_trainable(recipe, mesh), run_dir, step,
                                  console)
    return export_hf(recipe, params, out_dir, dtype, console=console), origin


def export_hf(recipe: Recipe, params: dict, out_dir: Path, dtype: str = "bfloat16",
              max_shard_bytes: int = 5 * 2**30, console=None) -> list[str]:
    """Writes the folder, in place of whatever `out_dir` held (the caller decided it may be
    replaced: output_files.check_target); returns the names of the files written."""
    is_main = jax.process_index() == 0
    if not is_main:  # the other processes take part in each gather and write nothing
        _write_hf(recipe, params, out_dir, dtype, max_shard_bytes, None, write=False)
        return []
    with replaced(out_dir, folder=True) as staging:
        _write_hf(recipe, params, staging, dtype, max_shard_bytes, console, write=True,
                  label=f"writing {out_dir}")
    return sorted(path.name for path in out_dir.iterdir())


def _write_hf(recipe: Recipe, params: dict, folder: Path, dtype: str, max_shard_bytes: int,
              console, write: bool, label: str = "") -> None:
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
    tokenizer = data_tokenizer(recipe.data)
    special = {}
    if tokenizer:
        special = {"eos_token_id": tokenizer.eos_id, "bos_token_id": tokenizer.bos_id}
        _copy_tokenizer_files(tokenizer, folder)
    config = config_json(recipe.model, recipe.data.seq_len, dtype, special)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _copy_tokenizer_files(tokenizer: DocumentTokenizer, out_dir: Path) -> None:
    source = Path(tokenizer.path)
    folder = source if source.is_dir() else source.parent
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out_dir / name)


def _on_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host: a device_get where this process holds every shard,
    else a gather over processes (every process must call it, in the same order)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
