"""A source checkpoint on disk: config + index + shards, checked against the schema.

``SourceCheckpoint(dir)`` parses ``config.json``, cross-checks
``model.safetensors.index.json`` against every shard header (no tensor data read), checks
that the tensor names, shapes and dtypes are exactly the schema's, and then serves tensors,
row slices and raw byte ranges by name, keeping one open reader per shard. The executor's
loader and the converter read weights only through this class.
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3bundle.config import K3Config, load_config
from k3bundle.errors import SchemaError
from k3bundle.io import INDEX_NAME, SafetensorsFile, TensorInfo, check_index
from k3bundle.schema import RELEASE_PREFIX, Schema, TensorSpec


class SourceCheckpoint:
    """A checked, read-only view of a Kimi K3 checkpoint directory."""

    def __init__(self, directory: str | Path, prefix: str = RELEASE_PREFIX):
        self.dir = Path(directory)
        self.config: K3Config = load_config(self.dir)
        self.schema = Schema(self.config, prefix=prefix)
        checked = check_index(self.dir)
        self.index = checked.index
        self._headers = checked.headers
        self.schema.check_keys(self.index.weight_map, where=str(self.dir / INDEX_NAME))
        self._check_shapes()
        self._open: dict[str, SafetensorsFile] = {}

    def _check_shapes(self) -> None:
        bad = []
        for name, shard in self.index.weight_map.items():
            spec = self.schema.get(name)
            info = self._headers[shard].tensors[name]
            if tuple(info.shape) != spec.shape or info.dtype != spec.dtype:
                bad.append(f"{shard}: {name} is {info.dtype} {list(info.shape)}, "
                           f"schema says {spec.dtype} {list(spec.shape)}")
        if bad:
            raise SchemaError(f"{self.dir}: {len(bad)} tensor(s) with the wrong shape or dtype, first {bad[0]}")

    # ---- lookup ----
    def spec(self, name: str) -> TensorSpec:
        return self.schema.get(name)

    def shard_of(self, name: str) -> str:
        return self.index.weight_map[self.schema.get(name).name]

    def info(self, name: str) -> TensorInfo:
        return self._headers[self.shard_of(name)].tensors[name]

    def _file(self, name: str) -> SafetensorsFile:
        return self.shard_file(self.shard_of(name))

    def shard_file(self, shard: str) -> SafetensorsFile:
        """The open reader of shard file ``shard`` (opened once, with the header checked at start)."""
        f = self._open.get(shard)
        if f is None:
            f = self._open[shard] = SafetensorsFile(self.dir / shard, header=self._headers[shard])
        return f

    # ---- reads (never whole files) ----
    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get(name)

    def get_stack(self, names: list[str]) -> torch.Tensor:
        """Tensors of one shape and dtype (a layer's routed experts) as one [len(names), ...] stack,
        each read straight into its row."""
        first = self.info(names[0])
        out = torch.empty(len(names), *first.shape, dtype=first.torch_dtype)
        for row, name in zip(out, names):
            self._file(name).get_into(name, row)
        return out

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._file(name).get_rows(name, start, stop)

    def read_bytes(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        return self._file(name).read_bytes(name, start, stop)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> "SourceCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
