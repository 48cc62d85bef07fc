"""Safetensors I/O: the dtype table, a strict lazy reader, a deterministic writer, the index.

The names below are loaded from their modules on first use (PEP 562), so that importing one
torch-free module of this package (``dtypes``, ``files``) does not load the reader and writer.
"""

import importlib

_MODULE_OF = {
    **dict.fromkeys(("SAFETENSORS_DTYPES", "TORCH_TO_SAFETENSORS", "dtype_bits", "from_torch", "tensor_nbytes",
                     "to_torch"), "dtypes"),
    **dict.fromkeys(("INDEX_NAME", "IndexCheck", "SafetensorsIndex", "check_index", "read_index", "write_index"),
                    "index"),
    **dict.fromkeys(("DEFAULT_MAX_HEADER_BYTES", "SafetensorsFile", "SafetensorsHeader", "TensorInfo", "read_header"),
                    "reader"),
    **dict.fromkeys(("TensorSource", "WrittenFile", "build_header", "write_safetensors"), "writer"),
}


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
