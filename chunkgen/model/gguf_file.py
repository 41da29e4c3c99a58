"""A GGUF file read lean: its metadata's values, its tensor table, each tensor a view of the mapped
file, in one pass over the header.

gguf's own GGUFReader builds every element of every metadata array as Python objects: for the
default model's vocabulary (49,152 tokens and 48,900 merges) that took 7.7 s of a 14 s load. Here
an array of strings is stepped over (each element's length read, nothing built) unless asked for,
and an array of numbers is a numpy view. The format is GGUF v2/v3 (llama.cpp's gguf.md): a header,
key/value pairs, a tensor table, then the tensor data from the next `general.alignment` boundary.
The file is data: every length and offset is checked against its size before it is used.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

VERSIONS = (2, 3)  # v1 counted in 32 bits; no file in use still has it
# metadata value types: the fixed-size ones by their struct code (8 is a string, 9 an array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# tensor types stored as plain values (the rest are blocks, viewed as bytes), as gguf's reader views them
VALUES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFError(ValueError):
    """The file is not a GGUF this reader can read; the message names it and what is wrong."""


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml's order, the row length first (as gguf's ReaderTensor.shape)
    tensor_type: int  # a GGMLQuantizationType value
    data: np.ndarray  # a view of the mapped file: the values [rows..., k], or bytes [rows..., bytes a row]
    offset: int = 0  # of its first byte in the file


class GGUFFile:
    """`fields`: the metadata (numbers, strings, numeric arrays as numpy views; an array of strings
    is its length unless named in `strings`); `tensors`: name -> Tensor, in the file's order."""

    def __init__(self, path: str | Path, strings: Container[str] = ()) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the descriptor
        self._size = len(self._map)
        self._pos = 0
        if self._take(4) != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic bytes)")
        version, tensor_count, field_count = self._unpack("<IQQ")
        if version not in VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version}; chunkgen reads versions 2 and 3")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind, key in strings, key)
        table = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFError(f"{self.path}: general.alignment {alignment!r} is not a positive integer")
        start = -(-self._pos // alignment) * alignment
        blob = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = {name: self._view(blob, name, dims, kind, start + off) for name, dims, kind, off in table}

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def release(self, tensor: Tensor) -> None:
        """Unmap the pages of a tensor that has been copied out (the file stays mapped; reading the
        tensor again faults them back in from the page cache). A load reads each tensor once, and
        the pages it touched would otherwise count in the process's memory until the file is
        closed: a 3.6 GiB model's whole file on top of its repacked weights."""
        page = mmap.PAGESIZE
        start = tensor.offset // page * page
        end = min(self._size, -(-(tensor.offset + tensor.data.nbytes) // page) * page)
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    # -- reading the header, bounds checked -------------------------------------------------------
    def _skip(self, n: int) -> int:
        """The position of the next n bytes, which are stepped over."""
        at = self._pos
        if n < 0 or at + n > self._size:
            raise GGUFError(f"{self.path}: truncated header (a value at byte {at} runs past the end)")
        self._pos = at + n
        return at

    def _take(self, n: int) -> bytes:
        at = self._skip(n)
        return self._map[at : at + n]

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack_from(fmt, self._map, self._skip(struct.calcsize(fmt)))

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        try:
            return self._take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a string at byte {self._pos - n} is not UTF-8") from None

    def _value(self, kind: int, keep_strings: bool, key: str) -> Any:
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise GGUFError(f"{self.path}: metadata {key} has value type {kind}, not one GGUF defines")
        element, count = self._unpack("<IQ")
        if element in SCALARS:
            code = "<" + SCALARS[element]
            at = self._skip(count * struct.calcsize(code))
            return np.frombuffer(self._map, dtype=code, count=count, offset=at)
        if element != STRING:
            raise GGUFError(f"{self.path}: metadata {key} is an array of type {element}, which chunkgen does not read")
        if count * 8 > self._size - self._pos:  # each element takes 8 bytes of length at least
            raise GGUFError(f"{self.path}: metadata {key} claims {count} strings, more than the file holds")
        if keep_strings:
            return [self._string() for _ in range(count)]
        length, mapped, size = struct.Struct("<Q").unpack_from, self._map, self._size
        pos = self._pos
        for _ in range(count):  # the lengths only: nothing is built
            pos += 8 + length(mapped, pos)[0]
            if pos > size:
                raise GGUFError(f"{self.path}: metadata {key} runs past the end of the file")
        self._pos = pos
        return count

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"{self.path}: tensor {name} has {n_dims} dimensions (ggml has 1 to 4)")
        dims = self._unpack(f"<{n_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, tuple(int(d) for d in dims), kind, offset

    def _view(self, blob: np.ndarray, name: str, dims: tuple[int, ...], kind: int, start: int) -> Tensor:
        try:
            qtype = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(
                f"{self.path}: tensor {name} has type {kind}, which gguf {_gguf_version()} does not know"
            ) from None
        shape = tuple(reversed(dims))  # numpy's order: rows first
        if shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {name}: rows of {shape[-1]} values are not whole blocks of {block}")
        shape = (*shape[:-1], shape[-1] // block * size)
        nbytes = int(np.prod(shape, dtype=np.int64))
        if start + nbytes > self._size:
            raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
        data = blob[start : start + nbytes]
        if qtype in VALUES:
            width = np.dtype(VALUES[qtype]).itemsize
            data = data.view(VALUES[qtype]).reshape(*shape[:-1], shape[-1] // width)
        else:
            data = data.reshape(shape)
        return Tensor(name, dims, kind, data, start)


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
