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

# Real configs nest a few levels; transformers recurses over a config's nesting (deepcopy,
# to_dict) and hits Python's recursion limit somewhere past 450 levels, and json itself past
# about 1000. Deeper than this is a corrupt or hostile file, refused by name.
MAX_JSON_DEPTH = 100

# The special token ids tandem decodes with, from config.json and generation_config.json
# (HF generate reads the same names): one outside the vocabulary would fail every request,
# so the checkpoint is refused when it is loaded. pad_token_id is left out: tandem never
# feeds it, and checkpoints on the Hub store pad_token_id=-1 and the like.
_TOKEN_ID_FIELDS = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "forced_bos_token_id",
                    "forced_eos_token_id", "no_timestamps_token_id")
_TOKEN_LIST_FIELDS = ("suppress_tokens", "begin_suppress_tokens")
_TOKEN_MAP_FIELDS = ("lang_to_id", "task_to_id")  # Whisper's generation config


def load_hf_config(model_dir: str, trust_remote_code: bool = False):
    """The checkpoint's transformers config; never asks on stdin and never runs code from
    ``model_dir`` unless ``trust_remote_code``."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model={model_dir!r}: no config.json in the checkpoint directory")
    raw = read_json(path, f"model={model_dir!r}: cannot read config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"model={model_dir!r}: config.json holds {type(raw).__name__}, not an object")
    if not trust_remote_code:
        _refuse_remote_code(model_dir, raw)
    try:
        # Always a bool: with None, transformers asks on stdin whether to run the checkpoint's code.
        config = AutoConfig.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=bool(trust_remote_code)
        )
    except (ValueError, OSError, KeyError, TypeError, StrictDataclassError, RecursionError) as e:
        raise ValueError(f"model={model_dir!r}: cannot read config.json: {_cause(e)}") from e
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


def _cause(e: BaseException) -> str:
    return f"RecursionError: {e}" if isinstance(e, RecursionError) else str(e)


def json_depth(value) -> int:
    """How deeply ``value`` (parsed JSON) nests objects and arrays; iterative, so any depth
    is measured without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in item)
    return depth


def read_json(path: Path, what: str):
    """``path`` parsed, or ``ValueError`` starting with ``what``: unreadable, not JSON, or
    nested deeper than :data:`MAX_JSON_DEPTH` (which would end in a bare ``RecursionError``
    here or in transformers)."""
    try:
        value = json.loads(path.read_text())
    except RecursionError:
        raise ValueError(
            f"{what}: {path.name} nests objects or arrays too deeply for Python's JSON reader "
            f"(a config nests a few levels; more than {MAX_JSON_DEPTH} is refused): the file is corrupt"
        ) from None
    except (ValueError, OSError) as e:
        raise ValueError(f"{what}: {e}") from e
    depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"{what}: {path.name} nests objects or arrays {depth} levels deep (a config nests a few levels; "
            f"more than {MAX_JSON_DEPTH} is refused): the file is corrupt"
        )
    return value


def _too_deep_json(folder: Path) -> str | None:
    """The name of the first JSON file of ``folder`` nested deeper than :data:`MAX_JSON_DEPTH`."""
    for f in sorted(folder.glob("*.json")):
        try:
            read_json(f, str(f))
        except ValueError as e:
            if "nests objects or arrays" in str(e):
                return f.name
    return None


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
    except Exception as e:
        # The tokenizers library raises a bare Exception for a file it cannot parse; other
        # types outside these (an ImportError for a missing sentencepiece...) go through as they are.
        if not (type(e) is Exception or isinstance(e, (ValueError, OSError, KeyError, RecursionError))):
            raise
        # A JSON file nested too deeply: transformers' json.load raises RecursionError, the
        # tokenizers library a parse error at its depth limit (128); either way, name the file.
        deep = _too_deep_json(Path(path))
        if deep is not None:
            raise ValueError(
                f"tokenizer={path!r}: cannot load: {deep} nests objects or arrays more than "
                f"{MAX_JSON_DEPTH} levels deep: the file is corrupt"
            ) from None
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise ValueError(
                f"tokenizer={path!r}: the tokenizer needs Python code from its folder (auto_map in "
                "tokenizer_config.json). " + _REMOTE_CODE_HINT.format(dir=path)
            ) from e
        if type(e) is Exception or isinstance(e, RecursionError):
            raise ValueError(f"tokenizer={path!r}: cannot load: {type(e).__name__}: {e}") from e
        raise ValueError(f"tokenizer={path!r}: cannot load: {e}") from e


def check_token_ids(source: str, get, vocab_size: int) -> None:
    """Raise ``ValueError`` naming ``source`` (``config.json``, a generation_config.json), the
    field, the value and ``vocab_size`` when a special token id tandem decodes with is not an
    integer in ``[0, vocab_size)``. ``get(name)`` reads a field (None when unset)."""

    def bad(token) -> bool:
        return isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size

    vocab = f"the vocabulary [0, {vocab_size}) (vocab_size={vocab_size})"
    for name in (*_TOKEN_ID_FIELDS, *_TOKEN_LIST_FIELDS, *_TOKEN_MAP_FIELDS):
        value = get(name)
        if value is None:
            continue
        if name in _TOKEN_MAP_FIELDS and isinstance(value, dict):
            for key, token in value.items():
                if bad(token):
                    raise ValueError(f"{source}: {name}[{key!r}]={token!r} is not a token id of {vocab}")
        elif isinstance(value, (list, tuple)) and name in (*_TOKEN_LIST_FIELDS, "eos_token_id", "forced_eos_token_id"):
            for token in value:
                if bad(token):
                    raise ValueError(f"{source}: {name} holds {token!r}, which is not a token id of {vocab}")
        elif bad(value):
            raise ValueError(f"{source}: {name}={_short(value)} is not a token id of {vocab}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_generation_token_ids(
    model_cls: type[EncoderDecoderModel], hf_config, generation_config, source: str
) -> None:
    """:func:`check_token_ids` for a generation config (a transformers ``GenerationConfig``
    or the parsed JSON object) against the model's vocabulary."""
    if isinstance(generation_config, dict):
        get = generation_config.get
    else:
        def get(name):
            return getattr(generation_config, name, None)
    check_token_ids(source, get, model_cls.vocab_size(hf_config))


def _check_generation_config_file(model_cls, hf_config, model_dir: str, generation_config: str) -> None:
    """The token ids of the generation_config.json the engine will read for ``generation_config``
    ("auto": the checkpoint's, "none": none, else a directory). A file that is missing or not
    JSON is left to the generation-config loader, which names it."""
    if generation_config == "none":
        return
    path = Path(model_dir if generation_config == "auto" else generation_config) / "generation_config.json"
    if not path.is_file():
        return
    try:
        raw = read_json(path, str(path))
    except ValueError as e:
        if "nests objects or arrays" in str(e):
            raise
        return
    if isinstance(raw, dict):
        check_generation_token_ids(model_cls, hf_config, raw, str(path))


def check_model_config(
    model_cls: type[EncoderDecoderModel], hf_config, model_dir: str, dtype: torch.dtype, device: torch.device,
    generation_config: str = "auto", tensor_parallel_size: int = 1,
) -> None:
    """Reject, from arithmetic alone, a config the model cannot be built from, whose special
    token ids (config.json's, and those of the generation_config.json that ``generation_config``
    selects, as ``LLM(generation_config=...)`` does) lie outside the vocabulary, that the weight
    files cannot hold, or whose weights do not fit in ``device`` memory."""
    try:
        model_cls.check_config(hf_config)
        if tensor_parallel_size > 1:
            model_cls.check_tensor_parallel(hf_config, tensor_parallel_size)
    except ValueError as e:
        raise ValueError(f"model={model_dir!r}: {e}") from e
    try:
        vocab_size = model_cls.vocab_size(hf_config)
    except (TypeError, ValueError, AttributeError):
        vocab_size = None  # a model whose check_config lets a missing vocab_size through
    try:
        if isinstance(vocab_size, int) and vocab_size > 0:
            check_token_ids("config.json", lambda name: getattr(hf_config, name, None), vocab_size)
            _check_generation_config_file(model_cls, hf_config, model_dir, generation_config)
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
    if device.type != "cpu":  # each GPU holds its ranks' share (ranks on a CPU share its RAM)
        weight_bytes //= tensor_parallel_size
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
