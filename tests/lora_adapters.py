"""Tiny PEFT LoRA adapter directories for the engine-side LoRA tests (no download)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, r: int = 4,
                      target_modules: tuple[str, ...] = ("q_proj", "v_proj"), scale: float = 0.5) -> Path:
    """PEFT's ``save_pretrained`` of a LoRA over the checkpoint at ``base_dir``, its A and B
    random (seeded; PEFT's own init leaves B at zero, an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    speech = AutoConfig.from_pretrained(base_dir).model_type == "whisper"
    model = (AutoModelForSpeechSeq2Seq if speech else AutoModelForSeq2SeqLM).from_pretrained(base_dir)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(target_modules)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft.save_pretrained(out_dir)
    return Path(out_dir)
