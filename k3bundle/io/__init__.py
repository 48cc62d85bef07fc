"""Safetensors I/O: the dtype table, a strict lazy reader, a deterministic writer, the index."""

from k3bundle.io.dtypes import (
    SAFETENSORS_DTYPES,
    TORCH_TO_SAFETENSORS,
    dtype_bits,
    from_torch,
    tensor_nbytes,
    to_torch,
)
from k3bundle.io.index import (
    INDEX_NAME,
    IndexCheck,
    SafetensorsIndex,
    check_index,
    read_index,
    write_index,
)
from k3bundle.io.reader import (
    DEFAULT_MAX_HEADER_BYTES,
    SafetensorsFile,
    SafetensorsHeader,
    TensorInfo,
    read_header,
)
from k3bundle.io.writer import TensorSource, WrittenFile, build_header, write_safetensors

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "INDEX_NAME",
    "IndexCheck",
    "SAFETENSORS_DTYPES",
    "SafetensorsFile",
    "SafetensorsHeader",
    "SafetensorsIndex",
    "TORCH_TO_SAFETENSORS",
    "TensorInfo",
    "TensorSource",
    "WrittenFile",
    "build_header",
    "check_index",
    "dtype_bits",
    "from_torch",
    "read_header",
    "read_index",
    "tensor_nbytes",
    "to_torch",
    "write_index",
    "write_safetensors",
]
