"""Streaming checkpoint tensors from safetensors or ``pytorch_model.bin``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


class WeightLoadError(RuntimeError):
    pass


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a HF checkpoint directory, single or sharded."""
    d = Path(model_dir)
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = d / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise WeightLoadError(f"corrupt weight index {index}: {e}") from e
            files = [d / f for f in sorted(set(weight_map.values()))]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise WeightLoadError(f"weight shards listed in {index} are missing: {missing}")
            return files
        if (d / single).is_file():
            return [d / single]
    raise WeightLoadError(
        f"no weights in {d}: expected model.safetensors, pytorch_model.bin or a sharded index"
    )


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one at a time, so peak memory stays near one tensor."""
    for path in checkpoint_files(model_dir):
        if path.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except (SafetensorError, OSError, ValueError) as e:
                raise WeightLoadError(f"cannot read weights from {path}: {e}") from e
        else:
            try:
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises several unrelated types for bad files
                raise WeightLoadError(f"cannot read weights from {path}: {e}") from e
            yield from state.items()
            del state
