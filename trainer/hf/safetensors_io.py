"""safetensors files read and written with numpy alone, a slice or a tensor at a time.

The format is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape and byte range) and the raw bytes. Reading maps only the bytes of the tensor asked
for, so a process loads just the slices its devices hold; writing streams one tensor at a
time, so neither side ever holds a whole model. (The `safetensors` package's numpy reader
has no bfloat16, the dtype most checkpoints are in.)
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsError(ValueError):
    """A file that is not the safetensors the folder claims; names the file and the fix."""


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file


class SafetensorsFolder:
    """Every tensor of a Hugging Face folder: one model.safetensors, or the shards that
    model.safetensors.index.json lists."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.entries: dict[str, TensorEntry] = {}
        for path in self._files():
            self.entries.update(read_header(path))

    def _files(self) -> list[Path]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [name for name in names if not (self.folder / name).is_file()]
            if missing:
                raise SafetensorsError(f"{self.folder / missing[0]}: listed in {INDEX_FILE} "
                                       f"but missing; copy the whole model folder")
            return [self.folder / name for name in names]
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise SafetensorsError(f"{self.folder}: no *.safetensors weights (only "
                                   f"{', '.join(sorted(p.name for p in self.folder.iterdir()))}"
                                   f"); save the model with safe_serialization")
        return files

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """tensor[index] as float32, reading only the rows the index touches."""
        entry = self.entries[name]
        start, stop, _ = (index[0] if index else slice(None)).indices(entry.shape[0])
        row_bytes = entry.dtype.itemsize * int(np.prod(entry.shape[1:], dtype=np.int64))
        block = np.memmap(entry.path, dtype=entry.dtype, mode="r",
                          offset=entry.offset + start * row_bytes,
                          shape=(stop - start, *entry.shape[1:]))
        try:
            return np.array(block[(slice(None), *index[1:])], dtype=np.float32)
        finally:
            del block  # unmaps: pages read leave this process's memory


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor's entry, each checked to lie whole inside the file: a file cut short in
    its data fails here, naming the tensor, rather than in a memory map mid-load."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        raw_length = f.read(8)
        length = struct.unpack("<Q", raw_length)[0] if len(raw_length) == 8 else -1
        if not 0 < length <= file_size - 8:
            raise SafetensorsError(f"{path}: not a safetensors file (bad header length); "
                                   f"re-download or re-save it")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SafetensorsError(f"{path}: not a safetensors file (unreadable header); "
                                   f"re-download or re-save it") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(path, name, info, 8 + length)
        _check_bytes(entry, name, info, file_size)
        entries[name] = entry
    return entries


def _entry(path: Path, name: str, info: dict, data_start: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise SafetensorsError(f"{path}: tensor {name} has no dtype, shape and data_offsets "
                               f"in the header; re-download or re-save the file")
    if info["dtype"] not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name} is {info['dtype']}; lctrain reads "
                               f"{', '.join(DTYPES)}")
    return TensorEntry(path, DTYPES[info["dtype"]], tuple(info["shape"]),
                       data_start + info["data_offsets"][0])


def _check_bytes(entry: TensorEntry, name: str, info: dict, file_size: int) -> None:
    begin, end = info["data_offsets"]
    expected = entry.dtype.itemsize * int(np.prod(entry.shape, dtype=np.int64))
    if end - begin != expected:
        raise SafetensorsError(
            f"{entry.path}: tensor {name} spans {end - begin:,} bytes, but its shape "
            f"{list(entry.shape)} in {DTYPE_NAMES[entry.dtype]} needs {expected:,}; "
            f"re-download or re-save the file")
    if entry.offset + expected > file_size:
        raise SafetensorsError(
            f"{entry.path}: tensor {name} ends at byte {entry.offset + expected:,}, past the "
            f"file's end ({file_size:,} bytes): the file is cut short; re-download it")


def write_folder(folder: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: np.dtype,
                 produce: Callable[[str], np.ndarray], max_shard_bytes: int = 5 * 2**30,
                 write: bool = True) -> None:
    """Writes `tensors` (name, shape) into folder as safetensors shards of at most
    max_shard_bytes (one model.safetensors when they fit in one, else model-0000i-of-0000n
    plus the index), calling produce(name) for each tensor's values in turn. With write
    False it only calls produce, in the same order (the other processes of a gather)."""
    shards = _split(tensors, dtype.itemsize, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    for name, shard in zip(names, shards):
        _write_file(folder / name if write else Path(os.devnull), shard, dtype, produce)
    if len(shards) == 1 or not write:
        return
    weight_map = {tensor: name for name, shard in zip(names, shards) for tensor, _ in shard}
    total = sum(int(np.prod(shape)) * dtype.itemsize for _, shape in tensors)
    (folder / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _split(tensors, itemsize: int, max_bytes: int) -> list[list]:
    shards, size = [[]], 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_file(path: Path, tensors: Iterable, dtype: np.dtype,
                produce: Callable[[str], np.ndarray]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in tensors:
            values = np.asarray(produce(name))
            if values.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {values.shape}, expected {shape}")
            f.write(np.ascontiguousarray(values.astype(dtype)).tobytes())
