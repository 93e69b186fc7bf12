"""A small GGUF reader: metadata and tensor layout from the header, tensor bytes as memory-mapped views.

Why not ``gguf.GGUFReader``: it parses every array in the header (49k tokenizer strings and merges for
SmolLM2), which takes ~3 s; reading a model's shapes must be fast. This reader skips arrays (it records
only their length) and maps the file once. Format (little-endian, versions 2 and 3):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: string, value_type u32, value)
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims (innermost first), ggml_type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data (offsets are relative to here)

A string is u64 length + UTF-8 bytes; an array is elem_type u32 + count u64 + elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type id -> struct format of a scalar of that type (8 = string, 9 = array are handled apart).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING_TYPE = 8
_ARRAY_TYPE = 9
_U64 = struct.Struct("<Q")  # a string's length


@dataclass(frozen=True)
class SkippedArray:
    """Stands in for a metadata array this reader did not decode (e.g. the tokenizer vocabulary)."""

    elem_type: int
    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch order (outermost first), e.g. a [out, in] weight is (out, in)
    data_start: int  # absolute byte offset in the file
    num_bytes: int


@dataclass
class GGUFFile:
    path: str
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensorInfo]
    mmap: np.ndarray  # uint8 view of the whole file, copy-on-write so torch can wrap slices without warnings
    data_offset: int  # where the tensor data starts: bytes before it are the header (metadata, tensor infos)

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The raw bytes of one tensor, shaped [rows, bytes per row] (rows = all but the innermost dim)."""
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return self.mmap[info.data_start : info.data_start + info.num_bytes].reshape(rows, -1)


class _Cursor:
    """Reads little-endian values from a buffer; raises ValueError (not struct.error) past the end."""

    def __init__(self, buffer: mmap.mmap, path: str) -> None:
        self.buffer = buffer
        self.path = path
        self.offset = 0

    def read(self, fmt: str) -> object:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buffer):
            raise ValueError(f"{self.path}: GGUF file is truncated or corrupt (header ends at byte {self.offset})")
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def read_uint(self, fmt: str) -> int:
        value = self.read(fmt)
        assert isinstance(value, int)
        return value

    def read_string(self) -> str:
        length = self.read_uint("<Q")
        if self.offset + length > len(self.buffer):
            raise ValueError(f"{self.path}: GGUF file is truncated or corrupt (string runs past the end)")
        raw = bytes(self.buffer[self.offset : self.offset + length])
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def skip_array(self, elem_type: int, length: int) -> None:
        if elem_type == _STRING_TYPE:
            # One tight loop over the lengths (49k strings twice for SmolLM2's tokenizer): every engine, server
            # and test process opens the header, several times.
            buffer, offset, end = self.buffer, self.offset, len(self.buffer)
            read_length = _U64.unpack_from
            for _ in range(length):
                if offset + 8 > end:
                    raise ValueError(f"{self.path}: GGUF file is truncated or corrupt (array runs past the end)")
                offset += 8 + read_length(buffer, offset)[0]
            self.offset = offset
        elif elem_type in _SCALAR_FORMATS:
            self.offset += struct.calcsize(_SCALAR_FORMATS[elem_type]) * length
        else:
            raise ValueError(f"{self.path}: unsupported GGUF array element type {elem_type}")
        if self.offset > len(self.buffer):
            raise ValueError(f"{self.path}: GGUF file is truncated or corrupt (array runs past the end)")

    def read_value(self, value_type: int) -> object:
        if value_type == _STRING_TYPE:
            return self.read_string()
        if value_type == _ARRAY_TYPE:
            elem_type = self.read_uint("<I")
            length = self.read_uint("<Q")
            self.skip_array(elem_type, length)
            return SkippedArray(elem_type, length)
        if value_type in _SCALAR_FORMATS:
            return self.read(_SCALAR_FORMATS[value_type])
        raise ValueError(f"{self.path}: GGUF file is corrupt (unknown value type {value_type} at byte {self.offset})")


def open_gguf(path: str) -> GGUFFile:
    """Parses the header of a GGUF file. Raises FileNotFoundError if missing, ValueError if not GGUF or cut short."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    file_size = os.path.getsize(path)
    if file_size < 24:
        raise ValueError(f"{path}: not a GGUF file (only {file_size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
        if header[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {header[:4]!r}, expected {GGUF_MAGIC!r})")
        metadata, raw_infos, data_offset = _parse_header(_Cursor(header, path))
    tensors = {}
    for name, dims, type_id, offset in raw_infos:
        info = _tensor_info(path, name, dims, type_id, data_offset + offset)
        if info.data_start + info.num_bytes > file_size:
            raise ValueError(
                f"{path}: GGUF file is truncated: tensor {name!r} needs bytes up to "
                f"{info.data_start + info.num_bytes}, the file has {file_size}"
            )
        tensors[name] = info
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, mmap=mapped, data_offset=data_offset)


_RawTensorInfo = tuple[str, list[int], int, int]  # name, dims (innermost first), ggml type id, relative offset


def _parse_header(cursor: _Cursor) -> tuple[dict[str, object], list[_RawTensorInfo], int]:
    """(metadata, tensor infos, absolute offset of the tensor data) from a header starting with the magic."""
    cursor.offset = 4
    version = cursor.read_uint("<I")
    if version not in (2, 3):
        raise ValueError(f"{cursor.path}: unsupported GGUF version {version} (supported: 2, 3; not big-endian)")
    num_tensors = cursor.read_uint("<Q")
    num_kvs = cursor.read_uint("<Q")
    metadata: dict[str, object] = {}
    for _ in range(num_kvs):
        key = cursor.read_string()
        metadata[key] = cursor.read_value(cursor.read_uint("<I"))
    raw_infos: list[_RawTensorInfo] = []
    for _ in range(num_tensors):
        name = cursor.read_string()
        num_dims = cursor.read_uint("<I")
        dims = [cursor.read_uint("<Q") for _ in range(num_dims)]
        raw_infos.append((name, dims, cursor.read_uint("<I"), cursor.read_uint("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"{cursor.path}: bad general.alignment {alignment!r}")
    return metadata, raw_infos, -(-cursor.offset // alignment) * alignment


def _tensor_info(path: str, name: str, dims: list[int], type_id: int, data_start: int) -> GGUFTensorInfo:
    """Shape in PyTorch order and the byte size, from GGUF dims (innermost first) and the block layout of the type."""
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    num_elements = int(np.prod(dims)) if dims else 1
    if dims and dims[0] % block_size != 0:
        raise ValueError(f"{path}: tensor {name!r} row length {dims[0]} is not a multiple of block size {block_size}")
    num_bytes = num_elements // block_size * type_size
    return GGUFTensorInfo(name, ggml_type, tuple(reversed(dims)), data_start, num_bytes)
