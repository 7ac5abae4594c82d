"""Give the demo Whisper (tandem/demo_whisper) Whisper's real decoder length, 448 positions.

The demo was trained with 64 decoder positions (its sentences and prompt take under 20), so
vLLM's Whisper examples (``max_model_len=448``, ``max_tokens=200``) were refused. This adds
positions 64..447 to ``model.decoder.embed_positions.weight``, each a copy of the last trained
one (63), and sets ``max_target_positions`` (config.json) to 448, as openai/whisper-* have.
Every other weight is unchanged, and so is ``max_length`` (generation_config.json, 64): the
default output length when a request gives none, so every default output stays as it was
(an explicit ``max_tokens`` may now reach 448 positions). ``tools/train_demo_whisper.py`` calls
this after training; run alone, it extends a checkpoint folder in place:

    python tools/extend_demo_whisper_positions.py tandem/demo_whisper
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KEY = "model.decoder.embed_positions.weight"
POSITIONS = 448


def extend(folder: Path, positions: int = POSITIONS) -> None:
    weights = load_file(folder / "model.safetensors")
    table = weights[KEY]  # [trained positions, d_model]
    if table.shape[0] > positions:
        raise ValueError(f"{folder}: {table.shape[0]} decoder positions already, more than {positions}")
    extra = table[-1:].expand(positions - table.shape[0], -1)
    weights[KEY] = torch.cat([table, extra]).contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["max_target_positions"] = positions
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--positions", type=int, default=POSITIONS)
    args = p.parse_args(argv)
    extend(args.folder, args.positions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
