"""Streaming checkpoint tensors from safetensors or ``pytorch_model.bin``."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# A large checkpoint takes tens of seconds to read: a line this often says how far it got.
PROGRESS_INTERVAL_S = 5.0


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
            _check_inside(d, index, f"weight index {index}")
            return _shard_files(d, index)
        if (d / single).is_file():
            _check_inside(d, d / single, f"weight file {d / single}")
            return [d / single]
    raise WeightLoadError(
        f"no weights in {d}: expected model.safetensors, pytorch_model.bin or a sharded index"
    )


def _shard_files(d: Path, index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text())
    except (ValueError, OSError) as e:
        raise WeightLoadError(f"corrupt weight index {index}: {e}") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightLoadError(
            f"corrupt weight index {index}: 'weight_map' must be a non-empty object of "
            f"tensor name -> shard file, got {_short(weight_map)}"
        )
    # JSON object keys are always strings, so only the values need checking.
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise WeightLoadError(
                f"corrupt weight index {index}: weight_map[{name!r}]={_short(shard)} is not a shard file name"
            )
    files = [_shard_path(d, index, shard) for shard in sorted(set(weight_map.values()))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(f"weight shards listed in {index} are missing: {missing}")
    return files


def _shard_path(d: Path, index: Path, shard: str) -> Path:
    """``d / shard``, refusing names that leave the checkpoint folder: the index is data, and
    must not make tandem read an arbitrary file on the machine as weights."""
    path = d / shard
    if Path(shard).is_absolute() or ".." in Path(shard).parts:
        raise WeightLoadError(
            f"weight index {index} names shard {shard!r}, which is outside the checkpoint folder {d}"
        )
    _check_inside(d, path, f"weight index {index} names shard {shard!r}")
    return path


def _check_inside(d: Path, path: Path, what: str) -> None:
    """Refuse ``path`` (a file of checkpoint folder ``d``) when it is a link whose target lies
    outside ``d``: a checkpoint is data, and must not make tandem read an arbitrary file on the
    machine as weights (the sharded and the single-file layouts alike). ``what`` starts the
    error message and names the file."""
    real, root = path.resolve(), d.resolve()
    # The Hugging Face hub cache keeps every file of snapshots/<revision>/ as a symlink into the
    # repository's blobs/ folder, outside the snapshot; that layout is a legitimate checkpoint.
    hub_blob = root.parent.name == "snapshots" and real.parent == root.parent.parent / "blobs"
    if not (real.is_relative_to(root) or hub_blob):
        raise WeightLoadError(f"{what}, a link to {real}, which is outside the checkpoint folder {d}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one at a time, so peak memory stays near one tensor; a read
    that runs past :data:`PROGRESS_INTERVAL_S` says how far it got at INFO, that often."""
    files = checkpoint_files(model_dir)
    total = sum(p.stat().st_size for p in files)
    started = time.monotonic()
    next_line = started + PROGRESS_INTERVAL_S
    done = 0
    for name, tensor in _read(files):
        yield name, tensor
        done += tensor.numel() * tensor.element_size()
        now = time.monotonic()
        if now >= next_line:
            logger.info("loading weights from %s: %.0f of %.0f MiB (%.0f s)", model_dir, done / 2**20,
                        total / 2**20, now - started)
            next_line = now + PROGRESS_INTERVAL_S


def _read(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
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
