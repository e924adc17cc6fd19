"""Qwen3-Next's fused Hugging Face tensors, each read whole and cut into our parameters,
and put back together for export.

transformers keeps, per layer: q_proj with each head's query then its output gate;
in_proj_qkvz with, per key head, its q, k, then its value heads' v and z; in_proj_ba with,
per key head, its value heads' b then a; conv1d's channels as all of q, all of k, all of
v. We keep every projection apart, per head ([d_model, heads, head_dim]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lctrain.recipes.schema import ModelConfig


@dataclass(frozen=True)
class FusedRows:
    """Our [d_model, groups x heads, head_rows] (or [d_model, groups x heads] where
    head_rows is None) as rows of an HF [groups x group_rows, d_model] matrix: in each
    group of rows, `heads` heads of head_rows rows from `offset`."""
    groups: int
    group_rows: int
    offset: int
    heads: int
    head_rows: int | None

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return self.groups * self.group_rows, ours[0]

    def ours(self, hf: np.ndarray) -> np.ndarray:
        width = self.heads * (self.head_rows or 1)
        rows = hf.reshape(self.groups, self.group_rows, -1)[:, self.offset:self.offset + width]
        heads = rows.reshape(self.groups * self.heads, self.head_rows or 1, -1)
        return heads.transpose(2, 0, 1) if self.head_rows else heads[:, 0].T

    def fill(self, hf: np.ndarray, ours: np.ndarray) -> None:
        heads = ours.transpose(1, 2, 0) if self.head_rows else ours.T[:, None]
        width = self.heads * (self.head_rows or 1)
        hf.reshape(self.groups, self.group_rows, -1)[:, self.offset:self.offset + width] = (
            heads.reshape(self.groups, width, -1))


@dataclass(frozen=True)
class ConvChannels:
    """Our [kernel, heads, head_dim] conv taps as channels [offset, offset + heads x
    head_dim) of HF's conv1d.weight [channels, 1, kernel]."""
    channels: int
    offset: int
    heads: int
    head_dim: int

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return self.channels, 1, ours[0]

    def ours(self, hf: np.ndarray) -> np.ndarray:
        taps = hf[self.offset:self.offset + self.heads * self.head_dim, 0, :].T
        return taps.reshape(taps.shape[0], self.heads, self.head_dim)

    def fill(self, hf: np.ndarray, ours: np.ndarray) -> None:
        hf[self.offset:self.offset + self.heads * self.head_dim, 0, :] = (
            ours.reshape(ours.shape[0], -1).T)


@dataclass(frozen=True)
class OutHeads:
    """Our [heads, head_dim, d_model] as HF's [d_model, heads x head_dim]."""
    heads: int
    head_dim: int

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return ours[2], self.heads * self.head_dim

    def ours(self, hf: np.ndarray) -> np.ndarray:
        return hf.T.reshape(self.heads, self.head_dim, -1)

    def fill(self, hf: np.ndarray, ours: np.ndarray) -> None:
        hf[...] = ours.reshape(self.heads * self.head_dim, -1).T


def fused_tensor(shape: tuple[int, ...], pieces: list[tuple[object, np.ndarray]]) -> np.ndarray:
    """The HF tensor of `shape` put together from (part, our layer's parameter) pieces."""
    hf = np.zeros(shape, np.float32)
    for part, ours in pieces:
        part.fill(hf, ours)
    return hf


def qwen3_next_parts(cfg: ModelConfig) -> dict[str, dict[tuple[str, ...], tuple[str, object]]]:
    """Per stack, our layer parameter path -> (the HF tensor of the layer it is cut
    from, how): the gated query of the attention layers, the linear layers' projections."""
    h, d = cfg.n_heads, cfg.head_dim
    hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    group = 2 * dk + 2 * r * dv
    channels = 2 * hk * dk + hv * dv
    qkvz, ba, conv = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight", \
        "linear_attn.conv1d.weight"
    linear = {
        "wq": (qkvz, FusedRows(hk, group, 0, 1, dk)),
        "wk": (qkvz, FusedRows(hk, group, dk, 1, dk)),
        "wv": (qkvz, FusedRows(hk, group, 2 * dk, r, dv)),
        "wz": (qkvz, FusedRows(hk, group, 2 * dk + r * dv, r, dv)),
        "wb": (ba, FusedRows(hk, 2 * r, 0, r, None)),
        "wa": (ba, FusedRows(hk, 2 * r, r, r, None)),
        "conv_q": (conv, ConvChannels(channels, 0, hk, dk)),
        "conv_k": (conv, ConvChannels(channels, hk * dk, hk, dk)),
        "conv_v": (conv, ConvChannels(channels, 2 * hk * dk, hv, dv)),
        "wo": ("linear_attn.out_proj.weight", OutHeads(hv, dv)),
    }
    return {"layers": {("attention", "wq"): ("self_attn.q_proj.weight",
                                             FusedRows(h, 2 * d, 0, 1, d)),
                       ("attention", "wg"): ("self_attn.q_proj.weight",
                                             FusedRows(h, 2 * d, d, 1, d))},
            "linear_layers": {("attention", name): part for name, part in linear.items()}}
