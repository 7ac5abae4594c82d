"""Where an adapter comes from: a local PEFT adapter directory as it is, or a Hugging Face
Hub repo id as a snapshot of its adapter files in the Hub cache (as checkpoints are:
``huggingface_hub`` fetches, ``HF_HUB_OFFLINE`` serves from the cache only)."""

from __future__ import annotations

from pathlib import Path

from tandem.core.checkpoint_source import _why_local_path
from tandem.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError

# Only the adapter's files; the .bin is fetched to say why it is refused.
ADAPTER_PATTERNS = [CONFIG_FILE, WEIGHTS_FILE, "adapter_model.bin"]


def resolve_adapter(path: str) -> Path:
    try:
        local = Path(path).expanduser()
        if local.is_dir():
            return local
        why = _why_local_path(path)
    except (OSError, RuntimeError) as e:
        raise AdapterError(f"not a local adapter directory ({e})") from None
    if why is not None:
        raise AdapterError(f"not a local adapter directory ({why})")
    from huggingface_hub import constants, snapshot_download

    try:
        folder = snapshot_download(path, allow_patterns=ADAPTER_PATTERNS, local_files_only=constants.HF_HUB_OFFLINE)
    except Exception as e:  # huggingface_hub raises validation, HTTP, offline and OS errors alike
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AdapterError(f"not a local adapter directory, nor a Hugging Face Hub adapter that can be fetched: "
                           f"{first}") from None
    return Path(folder)
