"""Where a checkpoint comes from: a local directory as it is, or a Hugging Face Hub repo id
as a local snapshot directory of the Hub cache (downloaded once, then served from the cache).

Everything downstream (config, tokenizer, weights, generation and preprocessor configs) reads
the directory :func:`resolve_checkpoint` returns and never sees a repo id. ``huggingface_hub``
does the fetching: its cache layout, its progress bars, ``HF_TOKEN`` and ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# What tandem reads from a checkpoint, as snapshot_download allow-patterns (fnmatch).
CONFIG_PATTERNS = ("config.json", "generation_config.json", "preprocessor_config.json")
TOKENIZER_PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "normalizer.json",
    "*.model",  # sentencepiece: spiece.model (T5), sentencepiece.bpe.model (mBART, NLLB), ...
    "*.spm",  # Marian's source.spm / target.spm
)
# The weight files tandem.core.checkpoint reads; .bin only for a repo without safetensors.
SAFETENSORS_PATTERNS = ("model.safetensors", "model.safetensors.index.json", "model-*.safetensors")
PYTORCH_BIN_PATTERNS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin")
_SAFETENSORS_NAMES = ("model.safetensors", "model.safetensors.index.json")
_WEIGHT_NAMES = (*_SAFETENSORS_NAMES, "pytorch_model.bin", "pytorch_model.bin.index.json")

# A path is at most PATH_MAX (4096 on Linux); a repo id at most 96 characters.
MAX_NAME_CHARS = 4096
MAX_REVISION_CHARS = 255
_SHOWN_CHARS = 120  # of a name or revision in a message

_TOKEN_HINT = "set HF_TOKEN to a token that can read it (https://huggingface.co/settings/tokens)"


def resolve_checkpoint(
    name, field: str = "model", *, revision: str | None = None, download_dir: str | None = None,
    weights: bool = True,
) -> str:
    """The local directory that holds checkpoint ``name``: ``name`` itself when it is a
    directory, else the Hub cache's snapshot of repo id ``name`` at ``revision`` (None: the
    repo's main branch), fetched into ``download_dir`` (None: huggingface_hub's default cache)
    unless ``HF_HUB_OFFLINE`` is set. ``weights=False`` (a tokenizer) fetches no weight files.
    Every failure is a ``ValueError`` naming ``field`` and ``name`` and saying what to do."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field}={_shown(name)}: must be a local checkpoint directory or a Hugging Face Hub repo "
                         "id ('org/name')")
    if revision is not None:
        check_revision(revision, of=f"{field}={_shown(name)}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{field}={_shown(name)}: too long for a local directory path or a Hugging Face Hub repo id "
                         f"(at most {MAX_NAME_CHARS} characters)")
    try:
        local = Path(name).expanduser()
    except RuntimeError:  # ~user of no known user
        local = Path(name)
    try:
        is_dir = local.is_dir()
        why_local = None if is_dir else _why_local_path(name)
    except OSError as e:  # a component over the file system's NAME_MAX, say: no path, and no repo id either
        raise ValueError(f"{field}={_shown(name)}: not a local checkpoint directory ({e.strerror or e}), nor a "
                         "Hugging Face Hub repo id ('org/name')") from None
    if is_dir:
        if revision is not None:
            raise ValueError(f"{field}={_shown(name)} is a local directory: a revision ({revision!r}) applies only "
                             "to a Hugging Face Hub repo id")
        return str(local)
    if why_local is not None:
        raise ValueError(f"{field}={_shown(name)}: not a local checkpoint directory ({why_local})")
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError as e:  # HFValidationError
        raise ValueError(f"{field}={_shown(name)}: not a local checkpoint directory, nor a Hugging Face Hub repo id "
                         f"('org/name'): {_first_line(e).replace(repr(name), 'it')}") from None
    return _snapshot(name, field, revision, download_dir, weights)


def check_revision(revision, field: str = "revision", of: str | None = None) -> None:
    """A ``ValueError`` naming ``field`` (and what it is the revision ``of``, when given) unless
    ``revision`` is a git revision that stays inside the Hub cache's ``refs/`` (huggingface_hub
    reads ``refs/<revision>`` offline and writes it after a download): a branch (``/`` allowed,
    as in ``refs/pr/1``), a tag or a commit hash; never ``..``, ``.`` or empty components, an
    absolute path, a backslash, a colon (a Windows drive) or a control character, all of which
    git refuses in ref names too."""
    of = f" (of {of})" if of else ""
    if not isinstance(revision, str) or not revision:
        raise ValueError(f"{field}={_shown(revision)}{of}: must be a branch, tag or commit hash (a non-empty string)")
    if len(revision) > MAX_REVISION_CHARS:
        raise ValueError(f"{field}={_shown(revision)}{of}: at most {MAX_REVISION_CHARS} characters")
    why = None
    if "\\" in revision or ":" in revision:
        why = "no backslash or colon"
    elif any(ord(c) < 32 or ord(c) == 127 for c in revision):
        why = "no control characters"
    elif revision.startswith("/"):
        why = "not an absolute path"
    elif any(part in ("", ".", "..") for part in revision.split("/")):
        why = "no '..', '.' or empty path components"
    if why is not None:
        raise ValueError(f"{field}={_shown(revision)}{of}: not a branch, tag or commit hash ({why}): a revision "
                         "names a ref of the repo and may not leave the Hub cache's refs/ directory")


def _shown(value) -> str:
    """``repr(value)``, cut for a message when long, with its length."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    length = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:_SHOWN_CHARS]}...{length}"


def _why_local_path(name: str) -> str | None:
    """Why ``name`` (not a directory) is meant as a local path rather than a repo id, if it is."""
    if name.startswith(("/", ".", "~", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "no such directory"
    path = Path(name)
    if path.exists():
        return "it is a file"
    if len(path.parts) > 1 and Path(path.parts[0]).is_dir():
        return f"no such directory under the local directory {path.parts[0]!r}"
    return None


def _snapshot(repo_id: str, field: str, revision: str | None, download_dir: str | None, weights: bool) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline, unreachable = bool(constants.HF_HUB_OFFLINE), None
    if offline:
        files = _cached_files(repo_id, revision, download_dir)
    else:
        try:
            files = _hub_files(repo_id, revision)
        except HfHubHTTPError as e:
            if _status(e) in (401, 403, 404) or _hub_error_kind(e) is not None:
                raise hub_error(e, field, repo_id, revision, download_dir) from e
            unreachable, files = e, _cached_files(repo_id, revision, download_dir)
        except (OSError, ConnectionError) as e:
            unreachable, files = e, _cached_files(repo_id, revision, download_dir)
        except Exception as e:  # httpx's transport errors are neither OSError nor ConnectionError
            if "httpx" not in type(e).__module__:
                raise
            unreachable, files = e, _cached_files(repo_id, revision, download_dir)
    patterns = allow_patterns(files, weights)
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
            local_files_only=offline or unreachable is not None,
        )
    except (HfHubHTTPError, FileNotFoundError, OSError) as e:
        folder = getattr(e, "snapshot_path", None)
        if type(e).__name__ != "IncompleteSnapshotError" or folder is None:
            raise hub_error(e, field, repo_id, revision, download_dir, offline=offline,
                            unreachable=unreachable) from e
        # Cached by a tool that fetched other files than tandem would (say, without the merges.txt
        # beside a tokenizer.json): what is there may serve; _check_snapshot and the loaders judge.
        logger.warning("%s %s: serving the cached snapshot as it is: %s", field, repo_id, _first_line(e))
    from_cache = offline or unreachable is not None
    _check_snapshot(Path(folder), field, repo_id, revision, weights, from_cache)
    logger.info("%s %s%s: %s%s", field, repo_id, f" at revision {revision}" if revision else "", folder,
                " (from the cache: HF_HUB_OFFLINE is set)" if offline else
                " (from the cache: the Hub cannot be reached)" if unreachable is not None else "")
    return folder


def allow_patterns(files: list[str] | None, weights: bool = True) -> list[str]:
    """The snapshot_download allow-patterns for what tandem reads from a repo holding ``files``
    (None: unknown): configs, tokenizer files and, with ``weights``, the safetensors weights, or
    ``pytorch_model*.bin`` when the repo has no safetensors weights."""
    patterns = [*CONFIG_PATTERNS, *TOKENIZER_PATTERNS]
    if weights:
        has_safetensors = files is None or any(f in _SAFETENSORS_NAMES for f in files)
        patterns += SAFETENSORS_PATTERNS if has_safetensors else PYTORCH_BIN_PATTERNS
    return patterns


def _hub_files(repo_id: str, revision: str | None) -> list[str] | None:
    from huggingface_hub import HfApi

    # model_info, not list_repo_files: one request, and no retries with backoff when the Hub
    # cannot be reached (the cache is the answer then).
    siblings = HfApi().model_info(repo_id, revision=revision).siblings
    return None if siblings is None else [s.rfilename for s in siblings]


def _cached_files(repo_id: str, revision: str | None, download_dir: str | None) -> list[str] | None:
    """The files of the cached snapshot of ``repo_id`` at ``revision``, or None when none is cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=download_dir, revision=revision)
    if not isinstance(found, str):
        return None
    snapshot = Path(found).parent
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def _check_snapshot(folder: Path, field: str, repo_id: str, revision: str | None, weights: bool,
                    from_cache: bool) -> None:
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    missing = None
    if not (folder / "config.json").is_file():
        missing = "no config.json"
    elif weights and not any((folder / f).is_file() for f in _WEIGHT_NAMES):
        missing = "no weights (model.safetensors or pytorch_model.bin, single or sharded)"
    if missing is None:
        return
    if from_cache:
        raise ValueError(
            f"{field}={repo_id!r}: the cached snapshot of {where} ({folder}) has {missing}: only part of the repo "
            "was cached (by another tool, or an interrupted download); run once with the Hub reachable and "
            "HF_HUB_OFFLINE unset to complete it"
        )
    raise ValueError(f"{field}={repo_id!r}: the Hugging Face Hub repo {where} has {missing}: it is not a "
                     "transformers checkpoint tandem can load")


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _hub_error_kind(e: BaseException) -> str | None:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    for cls, kind in ((GatedRepoError, "gated"), (RevisionNotFoundError, "revision"),
                      (RepositoryNotFoundError, "repo")):
        if isinstance(e, cls):
            return kind
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def hub_error(
    e: BaseException, field: str, repo_id: str, revision: str | None, download_dir: str | None = None, *,
    offline: bool = False, unreachable: BaseException | None = None,
) -> ValueError:
    """``e``, an error of ``huggingface_hub`` fetching ``repo_id``, as the ``ValueError`` a
    user can act on: the id, what went wrong and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    head = f"{field}={repo_id!r}: "
    rev = f" at revision {revision!r}" if revision else ""
    kind = _hub_error_kind(e)
    if kind == "gated":
        return ValueError(
            head + f"the Hugging Face Hub repo is gated: accept its conditions at https://huggingface.co/{repo_id} "
            f"with your account, then {_TOKEN_HINT.replace('that can read it', 'of that account')}"
        )
    if kind == "revision":
        return ValueError(head + f"the Hugging Face Hub repo has no revision {revision!r} (a branch, tag or commit "
                          "hash): check `revision`")
    if kind == "repo" or _status(e) == 401:
        return ValueError(
            head + "no such local directory, and no Hugging Face Hub repo of that id that this machine may read: "
            f"check the spelling (org/name), or, if the repo is private, {_TOKEN_HINT}"
        )
    if type(e).__name__ == "IncompleteSnapshotError":
        return ValueError(
            head + f"the cached snapshot{rev} is incomplete ({_first_line(e)}); run once with the Hub reachable "
            "and HF_HUB_OFFLINE unset to complete it"
        )
    if isinstance(e, LocalEntryNotFoundError):
        cache = download_dir or constants.HF_HUB_CACHE
        if offline:
            return ValueError(
                head + f"no such local directory, and not in the Hugging Face cache ({cache}){rev}, and "
                "HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded: run once with HF_HUB_OFFLINE unset to download it, or point `download_dir` "
                "(or HF_HOME / HF_HUB_CACHE) at the cache that holds it"
            )
        cause = f" ({_first_line(unreachable)})" if unreachable is not None else ""
        return ValueError(
            head + f"the Hugging Face Hub cannot be reached{cause}, and the repo{rev} is not in the cache ({cache}): "
            "check the network (or HF_ENDPOINT), or copy the checkpoint to a local directory"
        )
    status = _status(e)
    return ValueError(head + f"cannot fetch it from the Hugging Face Hub{rev}"
                      + (f" (HTTP {status})" if status else "") + f": {_first_line(e)}")
