"""Loading a checkpoint directory: config, tokenizer, model weights."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.core.attention import AttentionBackend
from tandem.core.model import EncoderDecoderModel, ModelContext
from tandem.model_zoo.weight_utils import WeightLoadError, iterate_weights

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model", "source.spm")


def load_hf_config(model_dir: str):
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"model={model_dir!r}: no config.json in the checkpoint directory")
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"model={model_dir!r}: cannot read config.json: {e}") from e


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts only)."""
    from transformers import AutoTokenizer

    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: only token-id prompts will work", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"tokenizer={path!r}: cannot load: {e}") from e


def load_model(
    model_cls: type[EncoderDecoderModel],
    hf_config,
    model_dir: str,
    backend: type[AttentionBackend],
    dtype: torch.dtype,
    device: torch.device,
) -> EncoderDecoderModel:
    """Build the model without initialising weights, then stream the checkpoint in."""
    ctx = ModelContext(attn_backend=backend, dtype=dtype, device=device)
    with torch.device("meta"):
        model = model_cls(hf_config, ctx)
    model = model.to_empty(device=device).to(dtype=dtype)
    try:
        model.load_weights(iterate_weights(model_dir))
    except WeightLoadError:
        raise
    except (ValueError, RuntimeError) as e:
        raise WeightLoadError(f"cannot load weights from {model_dir}: {e}") from e
    return model.eval()
