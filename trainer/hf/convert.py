"""Hugging Face weights <-> lctrain parameters: the name map, and the import.

Our layers are stacked on a leading axis and the projections keep heads apart
([d_model, heads, head_dim]); Hugging Face stores one [out, in] matrix per layer. Each
parameter has a layout saying how its block maps onto the HF tensor, so a device's shard
is read straight from the file: no process ever materializes the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from lctrain.recipes.schema import ModelConfig, RecipeError
from lctrain.trainer.hf.fused import qwen3_next_parts
from lctrain.trainer.hf.safetensors_io import SafetensorsError, SafetensorsFolder
from lctrain.trainer.outputs.progress import tracked

# Layouts, ours against Hugging Face's, per layer:
#   same       identical
#   transpose  [in, out] against [out, in]
#   in_heads   [d_model, heads, head_dim] against [heads * head_dim, d_model]  (q, k, v)
#   out_heads  [heads, head_dim, d_model] against [d_model, heads * head_dim]  (o)
#   bias       [heads, head_dim] against [heads * head_dim]
LAYER_TENSORS = {
    ("attention_norm", "scale"): ("input_layernorm.weight", "same"),
    ("attention", "wq"): ("self_attn.q_proj.weight", "in_heads"),
    ("attention", "wk"): ("self_attn.k_proj.weight", "in_heads"),
    ("attention", "wv"): ("self_attn.v_proj.weight", "in_heads"),
    ("attention", "wo"): ("self_attn.o_proj.weight", "out_heads"),
    ("attention", "bq"): ("self_attn.q_proj.bias", "bias"),
    ("attention", "bk"): ("self_attn.k_proj.bias", "bias"),
    ("attention", "bv"): ("self_attn.v_proj.bias", "bias"),
    ("attention", "q_norm", "scale"): ("self_attn.q_norm.weight", "same"),
    ("attention", "k_norm", "scale"): ("self_attn.k_norm.weight", "same"),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", "same"),
    ("mlp", "gate"): ("mlp.gate_proj.weight", "transpose"),
    ("mlp", "up"): ("mlp.up_proj.weight", "transpose"),
    ("mlp", "down"): ("mlp.down_proj.weight", "transpose"),
}
# With model.post_norms (Gemma 3) post_attention_layernorm is the norm of attention's output,
# and the MLP's input norm is pre_feedforward_layernorm.
POST_NORM_TENSORS = {
    ("attention_post_norm", "scale"): ("post_attention_layernorm.weight", "same"),
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", "same"),
    ("mlp_post_norm", "scale"): ("post_feedforward_layernorm.weight", "same"),
}
# Qwen3-Next's linear layers: Llama's norms and MLP, and the Gated DeltaNet's own tensors
# (its projections are cut from fused tensors: trainer/hf/fused.py).
LINEAR_TENSORS = {
    **{path: LAYER_TENSORS[path] for path in LAYER_TENSORS if path[0] != "attention"},
    ("attention", "dt_bias"): ("linear_attn.dt_bias", "same"),
    ("attention", "a_log"): ("linear_attn.A_log", "same"),
    ("attention", "norm_scale"): ("linear_attn.norm.weight", "same"),
}
MODEL_TENSORS = {
    ("embedding",): ("model.embed_tokens.weight", "same"),
    ("final_norm", "scale"): ("model.norm.weight", "same"),
    ("unembedding",): ("lm_head.weight", "transpose"),
}
# Buffers some exports carry that are not weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class HFTensor:
    """One parameter of ours: its path in the parameter dict, and per layer (or once, for
    layer None) the HF tensor and layout it comes from."""
    path: tuple[str, ...]
    hf_name: str          # with {layer} for stacked layers
    layout: str           # "part": cut from a fused HF tensor read whole, by `part`
    stacked: bool
    layer_numbers: tuple[int, ...] = ()  # the HF layer of each layer of our stack
    part: object = None   # a trainer/hf/fused.py part

    def name(self, layer: int | None = None) -> str:
        return self.hf_name.format(layer=None if layer is None else self.layer_numbers[layer])


def hf_tensors(params: dict, cfg: ModelConfig) -> list[HFTensor]:
    """The HF counterpart of every leaf of our parameter dict (real or abstract)."""
    tensors = []
    tables = {"layers": LAYER_TENSORS, "linear_layers": LINEAR_TENSORS}
    if "attention_post_norm" in params["layers"]:
        tables["layers"] = {**LAYER_TENSORS, **POST_NORM_TENSORS}
    parts = qwen3_next_parts(cfg) if cfg.family == "qwen3_next" else {}
    kinds = cfg.layer_kinds()
    numbers = {stack: tuple(i for i, kind in enumerate(kinds)
                            if (kind == "linear") == (stack == "linear_layers"))
               for stack in tables}
    for path, _ in _leaves(params):
        if path[0] in tables:
            if path[1:] in parts.get(path[0], {}):
                (name, part), layout = parts[path[0]][path[1:]], "part"
            else:
                (name, layout), part = tables[path[0]][path[1:]], None
            tensors.append(HFTensor(path, f"model.layers.{{layer}}.{name}", layout, True,
                                    numbers[path[0]], part))
        else:
            name, layout = MODEL_TENSORS[path]
            tensors.append(HFTensor(path, name, layout, False))
    return tensors


def _leaves(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def to_hf(layout: str, ours: np.ndarray) -> np.ndarray:
    """One layer's parameter of ours, laid out as Hugging Face stores it."""
    if layout == "transpose":
        return ours.T
    if layout == "in_heads":
        return ours.reshape(ours.shape[0], -1).T
    if layout == "out_heads":
        return ours.reshape(-1, ours.shape[-1]).T
    if layout == "bias":
        return ours.reshape(-1)
    return ours


def hf_shape(tensor: HFTensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape, for our parameter (one layer's) of `shape`."""
    if tensor.part is not None:
        return tensor.part.hf_shape(shape)
    return to_hf(tensor.layout, np.empty(shape, np.int8)).shape


def _hf_index(layout: str, index: tuple[slice, ...], shape: tuple[int, ...],
              head_dim: int) -> tuple[slice, ...]:
    """The region of the HF tensor that holds block `index` of ours (head_dim is never
    split, so a range of heads is a range of HF rows)."""
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))

    def heads(s: slice) -> slice:
        return slice(s.start * head_dim, s.stop * head_dim)

    if layout == "transpose":
        return index[::-1]
    if layout == "in_heads":
        return heads(index[1]), index[0]
    if layout == "out_heads":
        return index[2], heads(index[0])
    if layout == "bias":
        return (heads(index[0]),)
    return index


def _from_hf(layout: str, block: np.ndarray, head_dim: int) -> np.ndarray:
    """An HF block laid out as ours (the inverse of to_hf)."""
    if layout == "transpose":
        return block.T
    if layout == "in_heads":
        return block.reshape(-1, head_dim, block.shape[1]).transpose(2, 0, 1)
    if layout == "out_heads":
        return block.reshape(block.shape[0], -1, head_dim).transpose(1, 2, 0)
    if layout == "bias":
        return block.reshape(-1, head_dim)
    return block


def load_params(cfg: ModelConfig, shardings: dict, abstract_params: dict,
                console=None) -> dict:
    """The parameters of model.init=hf:<dir>, as float32 arrays with `shardings`: each
    device's block read from the files on the process that holds it (a bar on `console`)."""
    folder = cfg.hf_dir
    try:
        files = SafetensorsFolder(folder)
    except SafetensorsError as err:
        raise RecipeError(str(err)) from None
    tensors = hf_tensors(abstract_params, cfg)
    # A tied model's exports sometimes still carry the output matrix: the embedding's copy.
    ignored = IGNORED_SUFFIXES + (("lm_head.weight",) if cfg.tie_embeddings else ())
    _check_names_and_shapes(files, tensors, abstract_params, folder, ignored)
    params: dict = {}
    for tensor in tracked(console, tensors, f"loading {folder}"):
        shape = leaf_at(abstract_params, tensor.path).shape
        array = jax.make_array_from_callback(
            shape, leaf_at(shardings, tensor.path),
            lambda index, tensor=tensor, shape=shape: _read_block(files, tensor, index, shape,
                                                                  cfg.head_dim))
        _set(params, tensor.path, array)
    return params


def _read_block(files: SafetensorsFolder, tensor: HFTensor, index, shape, head_dim):
    if not tensor.stacked:
        return _from_hf(tensor.layout,
                        files.read(tensor.name(), _hf_index(tensor.layout, index, shape,
                                                            head_dim)), head_dim)
    layers = range(*index[0].indices(shape[0]))
    if tensor.part is not None:  # the layer's whole fused tensor, cut
        return np.stack([tensor.part.ours(files.read(tensor.name(i)))[index[1:]]
                         for i in layers])
    hf_index = _hf_index(tensor.layout, index[1:], shape[1:], head_dim)
    return np.stack([_from_hf(tensor.layout, files.read(tensor.name(i), hf_index), head_dim)
                     for i in layers])


def _check_names_and_shapes(files: SafetensorsFolder, tensors: list[HFTensor],
                            abstract_params: dict, folder: str,
                            ignored: tuple[str, ...]) -> None:
    expected = {}
    for tensor in tensors:
        shape = leaf_at(abstract_params, tensor.path).shape
        if tensor.stacked:
            expected.update({tensor.name(i): hf_shape(tensor, shape[1:])
                             for i in range(shape[0])})
        else:
            expected[tensor.name()] = hf_shape(tensor, shape)
    missing = sorted(set(expected) - set(files.entries))
    if missing:
        raise RecipeError(f"{folder}: tensor {missing[0]} is missing ({len(missing)} missing "
                          f"in all); the weights do not match config.json")
    unexpected = sorted(name for name in set(files.entries) - set(expected)
                        if not name.endswith(ignored))
    if unexpected:
        raise RecipeError(f"{folder}: unexpected tensor {unexpected[0]} ({len(unexpected)} in "
                          f"all); the weights do not match config.json's architecture")
    for name, shape in expected.items():
        if files.entries[name].shape != shape:
            raise RecipeError(f"{folder}: tensor {name} has shape "
                              f"{list(files.entries[name].shape)}, expected {list(shape)} from "
                              f"config.json; the weights do not match config.json")


def leaf_at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
