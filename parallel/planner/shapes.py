"""The shapes the planner counts: one device's share of the model's parameters
(parallel/model_arithmetic.py) and of a step.

Notation (per device): b rows of the batch (batch / (data*fsdp*accum)), c = mesh.context
(ring x ulysses), s_l = seq/c tokens, t = mesh.tensor, Z = fsdp*c (the ZeRO-3 group that
shares one copy of the weights), G = data*fsdp*c (devices whose gradients are summed), p =
bytes of the compute dtype. parallel/cost_model.Dims holds them (with the strategy's
Ulysses degree u and ring degree r), the form every strategy's cost model is written in.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from lctrain.parallel import STRATEGIES
from lctrain.parallel.cost_model import Dims
from lctrain.parallel.token_chunks import chunks_for, resolve_chunk_tokens
from lctrain.parallel.model_arithmetic import BYTES, Tensor, parameter_tensors
from lctrain.recipes.schema import Recipe

def _logical_sizes(axis_sizes: dict[str, int]) -> dict[str, int]:
    """Mesh size behind each logical axis (parallel/sharding.py LOGICAL_TO_MESH)."""
    zero = axis_sizes["fsdp"] * axis_sizes["context"]   # fsdp x context x ulysses
    t = axis_sizes["tensor"]
    return {"embed": zero, "heads": t, "kv_heads": t, "mlp": t, "vocab": t}


def local_elements(tensor: Tensor, axis_sizes: dict[str, int],
                   shard: Iterable[str] | None = None) -> int:
    """Elements of one device's shard (one layer's for per-layer tensors); a dimension
    its mesh axes do not divide stays whole, as in parallel/sharding.logical_spec.
    `shard` limits which logical axes are split (default: all)."""
    sizes = _logical_sizes(axis_sizes)
    count = 1
    for dim, axis in zip(tensor.shape, tensor.axes):
        size = sizes.get(axis, 1) if (shard is None or axis in shard) else 1
        count *= dim // size if dim % size == 0 else dim
    return count


@dataclasses.dataclass(frozen=True)
class Weights:
    """Elements per device of the parameters, in the forms memory and traffic count."""
    local: int            # every parameter's shard (layers stacked)
    layer_local: int      # one layer's shards
    layer_gathered: int   # one layer's matrices gathered over Z (split over tensor only)
    layer_norms: int      # d_model-wide norm vectors per layer (q/k norms, head_dim wide
                          # and replicated, are left out: 2 * head_dim elements)
    mlp_gathered: int     # remat.mlp_chunk_tokens: gate, up, down gathered once; else 0
    head: int             # the output weights gathered over Z
    embedding: int        # the embedding table gathered over Z


def weights(recipe: Recipe, axis_sizes: dict[str, int], c: int) -> Weights:
    tensors = parameter_tensors(recipe.model)
    by_name = {t.name: t for t in tensors}
    layer_matrices = [t for t in tensors if t.per_layer and len(t.shape) > 1]
    # remat.mlp_chunk_tokens: the MLP matrices are gathered once before the chunk loop and
    # kept float32 there, their gradient summed over the chunks and reduced in float32.
    mlp_chunked = chunks_for(recipe.remat.mlp_chunk_tokens, recipe.data.seq_len, c) is not None
    head = by_name.get("unembedding") or by_name["embedding"]

    def per_layer(tensors: list[Tensor], shard: tuple[str, ...] | None = None) -> int:
        """One layer's elements, averaged over the layers (attention and linear layers
        hold different tensors)."""
        return sum(local_elements(t, axis_sizes, shard) * t.layers
                   for t in tensors if t.per_layer) // recipe.model.layers

    return Weights(
        local=sum(local_elements(t, axis_sizes) * max(t.layers, 1) for t in tensors),
        layer_local=per_layer(tensors),
        layer_gathered=per_layer(layer_matrices, shard=("heads", "kv_heads", "mlp")),
        layer_norms=len([t for t in tensors if t.per_layer and t.axes == ("embed",)]),
        mlp_gathered=sum(local_elements(by_name[name], axis_sizes, shard=("mlp",))
                         for name in ("gate", "up", "down")) if mlp_chunked else 0,
        head=local_elements(head, axis_sizes, shard=("vocab",)),
        embedding=local_elements(by_name["embedding"], axis_sizes, shard=("vocab",)))


def dims(recipe: Recipe, axis_sizes: dict[str, int], strategy: str, ulysses: int) -> Dims:
    """One device's share of the step under `strategy` (Ulysses degree `ulysses` where
    the strategy takes one)."""
    m, a = recipe.model, axis_sizes
    t, c = a["tensor"], a["context"]
    accum = recipe.train.grad_accum_steps
    rows = max(recipe.data.batch_size // (a["data"] * a["fsdp"]), 1)
    u, r = STRATEGIES[strategy].degrees(c, ulysses)
    vocab_split = t if m.vocab % t == 0 else 1
    return Dims(b=max(rows // accum, 1), rows=rows, accum=accum, s=recipe.data.seq_len,
                c=c, u=u, r=r, t=t, z=a["fsdp"] * c, g=a["data"] * a["fsdp"] * c,
                p=BYTES[m.dtype], e=m.d_model, h=m.n_heads // t, kv=max(m.n_kv_heads // t, 1),
                d=m.head_dim, f=m.d_ff // t, v=m.vocab // vocab_split, layers=m.layers,
                remat=recipe.remat.policy, context_kept=context_kept(recipe))


def context_kept(recipe: Recipe) -> bool:
    """Whether the remat policy keeps attention's results, named `context` (offloaded
    ones too: jax then still recomputes a kernel's residuals, but not a ring's)."""
    policy = recipe.remat.policy
    return policy in ("save_all", "minimal") or (
        policy == "custom" and recipe.remat.tensors.get("context") in ("device", "offload"))


def checkpoint_shares(layers: int, every: int) -> tuple[float, float]:
    """(share of the layers whose input is saved, share run forward once more) with
    remat.layers_per_checkpoint = `every` (trainer/model/layer_scan.scan_layer_groups):
    each whole group saves its first layer's input and recomputes the others'; the layers
    after the last whole group save their own."""
    groups = layers // every
    return (groups + layers % every) / layers, groups * (every - 1) / layers


def loss_chunks(recipe: Recipe, c: int) -> tuple[int, int]:
    """(number of chunks, tokens per chunk per sequence per device) as trainer/model/loss.py
    cuts the local part of the sequence."""
    s = recipe.data.seq_len
    chunk = resolve_chunk_tokens(recipe.loss.chunk_tokens, s)
    part = s // c
    if chunk == s:
        return 1, part
    piece_limit = max(chunk // c, 1)
    n = -(-part // piece_limit)
    return n, -(-part // n)


def mlp_chunk_len(recipe: Recipe, c: int) -> int:
    """Tokens per sequence per device the MLP works on at a time (remat.mlp_chunk_tokens,
    cut as parallel/token_chunks.py cuts them)."""
    s = recipe.data.seq_len
    chunks = chunks_for(recipe.remat.mlp_chunk_tokens, s, c)
    return chunks.piece_len if chunks else s // c
