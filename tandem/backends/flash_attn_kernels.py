"""The flash_attn backend's three kernel sources, each behind its library's own call,
and what each accepts, asked of the installed package without importing it
(``import flash_attn`` loads its CUDA extension).

FA4's rules here are read from flash-attn-4's ``flash_attn/cute/interface.py``,
``flash_fwd_sm90.py`` and ``flash_fwd_sm100.py``; they hold, for the calls tandem
makes (equal K and V head dims, no sliding window, no block sparsity), in every
release from 4.0.0b11 to 4.0.0b36. 4.0.0b3 / b4 chose their tiles differently and
4.0.0b5-b10 refuse head size 256 on sm100, hence the floor in ``FA4_REQUIREMENT``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
from base64 import urlsafe_b64encode
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from tandem.backends.installed import dist_version as _version
from tandem.backends.installed import package_dirs as _package_dirs

MAX_HEAD_SIZE = 256
HEAD_ALIGN = 8  # 16 bytes of a 16-bit dtype: what every FlashAttention build asks of the head dim
FA2_PAGE_MULTIPLE = 256  # mha_varlen_fwd's rule for block_table, in flash-attn 2 and in torch's build
FA4_REQUIREMENT = "flash-attn-4>=4.0.0b11"  # names a pre-release, so pip picks the betas
FA2_REQUIREMENT = "flash-attn>=2.6"


# -- the kernels, each behind the library's own call ----------------------------


def _fa4(q, k, v, *, cu_q, max_q, cu_k, max_k, seqused_k, block_table, scale, causal):
    from flash_attn.cute import flash_attn_varlen_func

    if block_table is not None:  # page_table and cu_seqlens_k are exclusive: lengths come from seqused_k
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=max_q,
                                     seqused_k=seqused_k, page_table=block_table, softmax_scale=scale,
                                     causal=causal)
    else:
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                     max_seqlen_k=max_k, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def _fa2(q, k, v, *, cu_q, max_q, cu_k, max_k, seqused_k, block_table, scale, causal):
    from flash_attn import flash_attn_varlen_func

    # Paged or not, FA2 takes each sequence's key count from cu_seqlens_k.
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                  block_table=block_table)


def _torch(q, k, v, *, cu_q, max_q, cu_k, max_k, seqused_k, block_table, scale, causal):
    from torch.nn.attention.varlen import varlen_attn

    gqa = q.shape[1] != k.shape[-2]
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0) if causal else (-1, -1),
                       enable_gqa=gqa, seqused_k=seqused_k if block_table is not None else None,
                       block_table=block_table)


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str  # what must import for it to be there
    call: str  # the adapter's name in this module
    any_page_size: bool  # reads the paged cache in place at any block size (FA4: see fa4_reads_pages_in_place)
    min_capability: tuple[int, int]
    max_major: int | None  # highest compute-capability major it builds for
    install: str
    distribution: str | None  # the installed distribution that stands for ``module``
    interface: tuple[str, str]  # (file under the package, or "" to inspect the module; the function)
    positional: tuple[str, ...]  # the adapter's call: these by position, in this order ...
    keywords: frozenset[str]  # ... and these by name


KERNELS = (
    Kernel("fa4", "flash_attn.cute", "_fa4", True, (9, 0), 10, f"pip install '{FA4_REQUIREMENT}'", "flash-attn-4",
           ("cute/interface.py", "flash_attn_varlen_func"), ("q", "k", "v"),
           frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_k", "page_table",
                      "softmax_scale", "causal"})),
    Kernel("fa2", "flash_attn", "_fa2", False, (8, 0), None,
           f"pip install --no-build-isolation '{FA2_REQUIREMENT}' (a source build), then flash-attn-4 again if "
           "it was installed", "flash-attn",
           ("flash_attn_interface.py", "flash_attn_varlen_func"),
           ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
           frozenset({"softmax_scale", "causal", "block_table"})),
    Kernel("torch", "torch.nn.attention.varlen", "_torch", False, (8, 0), None, "torch >= 2.10 with CUDA", None,
           ("", "varlen_attn"), ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"),
           frozenset({"scale", "window_size", "enable_gqa", "seqused_k", "block_table"})),
)


# -- FA4's own rules ----------------------------------------------------------------


def fa4_key_tile(capability: tuple[int, int], head_size: int, causal: bool) -> int:
    """FA4's key tile (``n_block_size``) for tandem's calls on this GPU.

    sm90: ``_tile_size_fwd_sm90(head_dim, head_dim_v, is_causal, is_local)`` in
    flash_attn/cute/interface.py (with head_dim_v == head_dim, no local window);
    sm100 / sm110: ``_get_fwd_config``'s default 128, which it changes only for
    unequal head dims with split-KV."""
    if capability[0] != 9:
        return 128
    if head_size <= 64:
        return 128
    if head_size <= 96:
        return 128 if causal else 144
    if head_size <= 128:
        return 128
    if head_size <= 192:
        return 112  # 128 only when head_dim_v <= 128, and here head_dim_v == head_size
    return 80


def fa4_reads_pages_in_place(capability: tuple[int, int] | None, head_size: int, block_size: int,
                             causal: bool) -> bool:
    """Whether FA4 takes a paged cache of this page size at this head size.

    A page size other than the key tile loads K/V without TMA, and FA4 then asserts
    "Paged KV does not support irregular head dim" (``FlashAttentionForwardSm90`` /
    ``Sm100.__init__``) unless the head dim is a multiple of 16 (``check_hdim_oob``:
    the head dim differs from it padded to 16). With the GPU unknown, only head
    sizes that are multiples of 16 are safe."""
    if head_size % 16 == 0:
        return True
    return capability is not None and block_size == fa4_key_tile(capability, head_size, causal)


def fa4_head_size_problem(capability: tuple[int, int], head_size: int) -> str | None:
    """FA4's ``_validate_head_dims`` for equal head dims of a 16-bit dtype (sm90: a
    multiple of 8 in 8..256, as the backend's own rule; sm100 / sm110: 8..128 or 256)."""
    if capability[0] in (10, 11) and not (8 <= head_size <= 128 or head_size == 256):
        return (f"FA4 on sm{capability[0]}{capability[1]} takes head sizes 8..128 and 256, "
                f"not {head_size}")
    return None


# -- what is installed ----------------------------------------------------------------


def parameters_from_source(source: str, function: str) -> list[inspect.Parameter] | None:
    """``function``'s parameters as written at the top level of ``source`` (defaults
    stand as ``...``), or None when it is not defined there."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            a = node.args
            P = inspect.Parameter
            positional = [(x, P.POSITIONAL_ONLY) for x in a.posonlyargs] + [(x, P.POSITIONAL_OR_KEYWORD) for x in a.args]
            first_default = len(positional) - len(a.defaults)
            params = [P(x.arg, kind, default=... if i >= first_default else P.empty)
                      for i, (x, kind) in enumerate(positional)]
            if a.vararg:
                params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
            params += [P(x.arg, P.KEYWORD_ONLY, default=P.empty if d is None else ...)
                       for x, d in zip(a.kwonlyargs, a.kw_defaults)]
            if a.kwarg:
                params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
            return params
    return None


def call_problem(kernel: Kernel, params: list[inspect.Parameter]) -> str | None:
    """Why the adapter's call would not bind to ``params``, or None."""
    P = inspect.Parameter
    by_position = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    named = {p.name: p for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    any_keyword = any(p.kind is P.VAR_KEYWORD for p in params)
    takes = [p.name for p in by_position[: len(kernel.positional)]]
    if takes != list(kernel.positional) and not any(p.kind is P.VAR_POSITIONAL for p in params):
        return f"takes ({', '.join(takes)}) first where tandem passes ({', '.join(kernel.positional)})"
    missing = sorted(n for n in kernel.keywords if n not in named and not any_keyword)
    if missing:
        return "has no " + ", ".join(missing)
    given = set(kernel.positional) | kernel.keywords
    required = [p.name for p in params if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
                and p.name not in given]
    if required:
        return "requires " + ", ".join(required) + ", which tandem does not pass"
    return None


def _sha256_record(path: Path) -> str:
    return "sha256=" + urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def _owner_note(kernel: Kernel, path: Path) -> str:
    """Whether ``path`` is the file ``kernel.distribution`` installed, from its RECORD."""
    dist = importlib.metadata.distribution(kernel.distribution)
    rel = f"flash_attn/{kernel.interface[0]}"
    recorded = next((f for f in dist.files or () if f.as_posix() == rel), None)
    if recorded is None or recorded.hash is None:
        return ""
    if f"{recorded.hash.mode}={recorded.hash.value}" == _sha256_record(path):
        return f" (the file {kernel.distribution} {dist.version} installed)"
    return f" (not the file {kernel.distribution} {dist.version} installed: another package overwrote it)"


@functools.lru_cache(maxsize=None)
def interface_problem(kernel: Kernel) -> str | None:
    """Why the installed ``kernel`` cannot take tandem's call, or None. Cached: tests
    that change what is installed call ``interface_problem.cache_clear()``."""
    if kernel.name == "fa4":
        version = _version("flash-attn-4")
        floor = FA4_REQUIREMENT.split(">=")[1]
        try:
            too_old = version is not None and Version(version) < Version(floor)
        except InvalidVersion:
            too_old = False
        if too_old:
            return (f"flash-attn-4 {version} is older than {floor}, the first whose tile and head-size rules "
                    f"tandem follows: pip install -U '{FA4_REQUIREMENT}'")
    file, function = kernel.interface
    if not file:
        # Read from the module's source, not imported: torch.nn.attention.varlen imports
        # torch._dynamo (and with it triton), seconds that a capability check must not cost.
        try:
            spec = importlib.util.find_spec(kernel.module)
        except (ImportError, ValueError) as e:
            return f"{kernel.module} cannot be found: {e}"
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        if origin is None or not origin.is_file():
            return f"{kernel.module} is not installed"
        params = parameters_from_source(origin.read_text(encoding="utf-8"), function)
        if params is None:
            return f"{origin} defines no {function}"
        where = f"{kernel.module}.{function}"
    else:
        path = next((d / file for d in _package_dirs("flash_attn") if (d / file).is_file()), None)
        if path is None:
            return f"flash_attn/{file} is not installed"
        params = parameters_from_source(path.read_text(encoding="utf-8"), function)
        if params is None:
            return f"{path} defines no {function}"
        where = f"{function} in {path}"
    problem = call_problem(kernel, params)
    if problem is None:
        return None
    text = f"{where} {problem}"
    if kernel.name == "fa4":
        fa2 = _version("flash-attn")
        text += _owner_note(kernel, path)
        text += (f"; flash-attn {fa2} is installed too and its sdist ships an older flash_attn/cute" if fa2 else "")
        text += (f": reinstall flash-attn-4 after flash-attn "
                 f"(pip install --force-reinstall --no-deps '{FA4_REQUIREMENT}')")
    return text


def _importable(kernel: Kernel) -> bool:
    # Installed distributions stand for the kernel packages: asking importlib for
    # ``flash_attn.cute`` would import ``flash_attn`` (CUDA libraries and all).
    if kernel.distribution is not None:
        return _version(kernel.distribution) is not None
    try:
        return importlib.util.find_spec(kernel.module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def kernel_problem(kernel: Kernel, capability: tuple[int, int] | None, head_size: int) -> str | None:
    """Why ``kernel`` cannot serve this GPU (``capability`` None: unknown) at this
    head size, or None."""
    if not _importable(kernel):
        return f"not installed ({kernel.install})"
    if capability is not None:
        major = capability[0]
        if capability < kernel.min_capability or (kernel.max_major is not None and major > kernel.max_major):
            top = f"..sm{kernel.max_major}x" if kernel.max_major is not None else "+"
            return (f"builds for sm{kernel.min_capability[0]}{kernel.min_capability[1]}{top}, "
                    f"not compute capability {major}.{capability[1]}")
        if kernel.name == "fa4":
            problem = fa4_head_size_problem(capability, head_size)
            if problem:
                return problem
    return interface_problem(kernel)


def pages_in_place(kernel: Kernel, block_size: int, capability: tuple[int, int] | None, head_size: int,
                   causal: bool) -> bool:
    """Whether ``kernel`` reads the paged cache in place at this block size (else the
    step's K/V are gathered into packed runs first)."""
    if kernel.any_page_size:
        return fa4_reads_pages_in_place(capability, head_size, block_size, causal)
    return block_size % FA2_PAGE_MULTIPLE == 0
