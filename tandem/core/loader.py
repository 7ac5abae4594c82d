"""Loading a checkpoint directory: config, tokenizer, model weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tandem.core.attention import AttentionBackend
from tandem.core.memory import check_fits
from tandem.core.model import EncoderDecoderModel, ModelContext
from tandem.core.checkpoint import WeightLoadError, checkpoint_files, iterate_weights

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model", "source.spm")


_REMOTE_CODE_HINT = (
    "tandem never runs Python code shipped in a checkpoint unless asked: if you trust the code in "
    "{dir}, pass LLM(trust_remote_code=True) (--trust-remote-code on the command line)"
)

# The weight files must hold at least one byte per parameter the config implies: the smallest
# element types (int8, uint8, float8, bool) take one byte, load_weights needs every parameter in
# its full shape (so packed sub-byte formats cannot load anyway), and tied weights are stored once
# and counted once by num_parameters. So a loadable checkpoint has params <= file bytes, 2x under
# the bound for fp16/bf16 and 4x for fp32; the 5% and 1 MiB only absorb a num_parameters that
# slightly over-counts, e.g. a parameter some checkpoints omit.
_BYTES_PER_PARAM_FLOOR = 1
_PARAMS_MARGIN, _PARAMS_SLACK = 1.05, 1 << 20


def load_hf_config(model_dir: str, trust_remote_code: bool = False):
    """The checkpoint's transformers config; never asks on stdin and never runs code from
    ``model_dir`` unless ``trust_remote_code``."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model={model_dir!r}: no config.json in the checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"model={model_dir!r}: cannot read config.json: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"model={model_dir!r}: config.json holds {type(raw).__name__}, not an object")
    if not trust_remote_code:
        _refuse_remote_code(model_dir, raw)
    try:
        # Always a bool: with None, transformers asks on stdin whether to run the checkpoint's code.
        config = AutoConfig.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=bool(trust_remote_code)
        )
    except (ValueError, OSError, KeyError, TypeError, StrictDataclassError) as e:
        raise ValueError(f"model={model_dir!r}: cannot read config.json: {e}") from e
    archs = getattr(config, "architectures", None)
    # A single string is rejected rather than wrapped: transformers and other tools would read
    # it letter by letter too, so the checkpoint is broken and should be fixed where it lives.
    names_ok = isinstance(archs, (list, tuple)) and all(isinstance(a, str) for a in archs)
    if archs is not None and not names_ok:
        raise ValueError(
            f"model={model_dir!r}: config.json: architectures={archs!r} must be a list of class names, "
            'e.g. ["BartForConditionalGeneration"]'
        )
    return config


def _refuse_remote_code(model_dir: str, raw: dict) -> None:
    """Fail fast on a config that only code from the checkpoint folder can read."""
    from transformers import CONFIG_MAPPING

    auto_map, model_type = raw.get("auto_map"), raw.get("model_type")
    if not auto_map:
        return
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        # transformers reads a model_type it knows with its own class; the folder's code stays unread.
        logger.warning(
            "%s: config.json's auto_map %r is ignored, its code is not run (trust_remote_code=False)",
            model_dir, auto_map,
        )
        return
    raise ValueError(
        f"model={model_dir!r}: config.json needs Python code from the checkpoint folder "
        f"(auto_map={auto_map!r}; model_type={model_type!r} is not one transformers knows). "
        + _REMOTE_CODE_HINT.format(dir=model_dir)
    )


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts only)."""
    from transformers import AutoTokenizer

    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: only token-id prompts will work", path)
        return None
    try:
        # Always a bool: with None, transformers asks on stdin whether to run the checkpoint's code.
        return AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=bool(trust_remote_code)
        )
    except (ValueError, OSError, KeyError) as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise ValueError(
                f"tokenizer={path!r}: the tokenizer needs Python code from its folder (auto_map in "
                "tokenizer_config.json). " + _REMOTE_CODE_HINT.format(dir=path)
            ) from e
        raise ValueError(f"tokenizer={path!r}: cannot load: {e}") from e


def check_model_config(
    model_cls: type[EncoderDecoderModel], hf_config, model_dir: str, dtype: torch.dtype, device: torch.device
) -> None:
    """Reject, from arithmetic alone, a config the model cannot be built from, that the weight
    files cannot hold, or whose weights do not fit in ``device`` memory."""
    try:
        model_cls.check_config(hf_config)
    except ValueError as e:
        raise ValueError(f"model={model_dir!r}: {e}") from e
    num_params = model_cls.num_parameters(hf_config)
    if num_params is None:
        return
    files = checkpoint_files(model_dir)
    file_bytes = sum(f.stat().st_size for f in files)
    held = file_bytes // _BYTES_PER_PARAM_FLOOR
    if num_params > held * _PARAMS_MARGIN + _PARAMS_SLACK:
        sizes = ", ".join(f"{k}={getattr(hf_config, k, None)}" for k in model_cls.config_size_fields)
        raise ValueError(
            f"model={model_dir!r}: config.json ({sizes}) implies {num_params:,} parameters, but the "
            f"weight files total {file_bytes:,} bytes, room for at most {held:,} parameters at "
            f"{_BYTES_PER_PARAM_FLOOR} byte each: config.json does not match the checkpoint"
        )
    weight_bytes = num_params * dtype.itemsize
    check_fits(
        f"the model weights ({num_params:,} parameters x {dtype.itemsize} bytes for "
        f"dtype={str(dtype).removeprefix('torch.')})",
        weight_bytes,
        device,
        "pick a smaller dtype, another device, or free some memory",
    )


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
        # Cast while still on meta, so memory is allocated once, in the target dtype.
        model = model_cls(hf_config, ctx).to(dtype=dtype)
    model = model.to_empty(device=device)
    try:
        model.load_weights(iterate_weights(model_dir))
    except WeightLoadError:
        raise
    except (ValueError, RuntimeError) as e:
        raise WeightLoadError(f"cannot load weights from {model_dir}: {e}") from e
    return model.eval()
