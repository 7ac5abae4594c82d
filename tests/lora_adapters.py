"""Tiny PEFT LoRA adapters over the tiny test checkpoints (no download), and the oracle they
are checked against: PEFT's own merge (``PeftModel.from_pretrained(...).merge_and_unload()``) saved as
a plain checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def hf_model(base_dir: Path):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    kind = AutoConfig.from_pretrained(base_dir).model_type
    auto = AutoModelForSpeechSeq2Seq if kind == "whisper" else AutoModelForSeq2SeqLM
    return auto.from_pretrained(base_dir, dtype=torch.float32).eval()


def make_adapter(base_dir: Path, out_dir: Path, targets, *, seed: int = 0, r: int = 4, alpha: float = 8,
                 std: float = 0.3, **config) -> Path:
    """``get_peft_model`` + ``save_pretrained`` of a LoRA on ``targets``, A and B random
    (PEFT initialises B to zero: an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(hf_model(base_dir), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                         **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft.save_pretrained(out_dir)
    return Path(out_dir)


def merged_checkpoint(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """PEFT's merge of the adapter into the base, saved with the base's other files."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(hf_model(base_dir), str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir)
    for f in Path(base_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not (out_dir / f.name).exists():
            shutil.copy(f, out_dir / f.name)
    cfg = json.loads((Path(base_dir) / "config.json").read_text())  # the base's exact config (tying flags)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return Path(out_dir)


def edit_config(adapter_dir: Path, **fields) -> None:
    path = Path(adapter_dir) / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, r: int = 4,
                      target_modules: tuple[str, ...] = ("q_proj", "v_proj"), scale: float = 0.5) -> Path:
    """A LoRA on ``target_modules`` with ``lora_alpha = 2 r`` and A, B ~ N(0, scale^2)."""
    return make_adapter(base_dir, out_dir, target_modules, seed=seed, r=r, alpha=2 * r, std=scale)
