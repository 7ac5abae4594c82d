"""``LLM``: offline batched generation."""

from __future__ import annotations

import gc
import inspect
import itertools
import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from tandem.core.config import EngineConfig
from tandem.core.engine_args import check_kwargs, describe_options, signature as engine_signature
from tandem.core.engine import LLMEngine
from tandem.core.faults import EngineDeadError
from tandem.core.inputs import PromptType, preview
from tandem.core.outputs import RequestOutput, rejected_output
from tandem.core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from tandem.entrypoints import replicas
from tandem.entrypoints.vllm_compat import split_vllm_options
from tandem.lora.request import LoRARequest, lora_list
from tandem.plugins import default_backend_registry, default_mode_registry, default_model_registry

if TYPE_CHECKING:
    from tandem.core.inputs import PromptSlot


class LLM:
    """Generate with an encoder/decoder model from a local checkpoint directory or a
    Hugging Face Hub repo id (downloaded once into the Hub cache, served from it offline).

    >>> llm = LLM(model="path/to/bart", dtype="float32")  # or LLM("facebook/bart-large-cnn")
    >>> llm.generate(["The rain in spain"], SamplingParams(temperature=0.0, max_tokens=32))
    """

    def __init__(self, model: str, *, data_parallel_size: int = 1, **engine_args) -> None:
        replica_args = dict(engine_args)
        # vLLM's keywords (max_model_len, limit_mm_per_prompt, ...): entrypoints/vllm_compat.py
        engine_args, vllm_options = split_vllm_options(engine_args)
        check_kwargs("LLM", engine_args)
        size = replicas.check_size(data_parallel_size)
        config = EngineConfig(model=model, **engine_args)
        # Replicas 1.. start loading beside this process's engine (replica 0): entrypoints/replicas.py.
        self._pool: replicas.ReplicaPool | None = None
        self._threads_each = 0
        if size > 1:
            import torch

            self._threads_each = replicas.threads_each(torch.get_num_threads(), size)
            self._pool = replicas.ReplicaPool(model, replica_args, size, self._threads_each, config.seed)
        try:
            self.llm_engine = LLMEngine(config, default_model_registry(), default_backend_registry(),
                                        default_mode_registry())
        except BaseException:
            if self._pool is not None:
                self._pool.shutdown()
            raise
        try:
            vllm_options.check_engine(self.llm_engine)
            if self._pool is not None:
                self._pool.wait_ready()
        except BaseException:
            self.llm_engine.shutdown()
            if self._pool is not None:
                self._pool.shutdown()
            raise
        self._ids = itertools.count()
        # The engine is single-threaded: concurrent generate() calls take turns.
        self._lock = threading.Lock()
        self._session_thread: int | None = None  # the thread inside session(), if any

    # The keywords are EngineConfig's fields: help(LLM) and inspect.signature show them.
    __init__.__signature__ = engine_signature(inspect.Parameter("data_parallel_size", inspect.Parameter.KEYWORD_ONLY,
                                                                default=1, annotation=int))
    __init__.__doc__ = (
        "Build the engine for ``model``, a checkpoint directory or a Hub repo id. ``data_parallel_size``: engine "
        "replicas ``generate`` deals its prompts out to, each in a process of its own with its share of the torch "
        "threads (``tandem.entrypoints.replicas``; 1: this process's engine alone). Engine options (each also a "
        "flag of the ``tandem`` commands that build an engine: ``--max-num-seqs`` for ``max_num_seqs``):\n\n"
        + describe_options()
    )

    @property
    def data_parallel_size(self) -> int:
        """Engine replicas ``generate`` uses: this process's and the live ones in processes of their own."""
        return 1 + (len(self._pool.live()) if self._pool is not None else 0)

    def shutdown(self) -> None:
        """Stop the engine's workers and the replica processes; idempotent. (Also done when the
        ``LLM`` is collected and at interpreter exit.)"""
        if self._pool is not None:
            self._pool.shutdown()
        self.llm_engine.shutdown()

    @property
    def engine(self) -> LLMEngine:
        """The engine (also ``llm_engine``, vLLM's name)."""
        return self.llm_engine

    def get_tokenizer(self):
        """The Hugging Face tokenizer."""
        return self.llm_engine.get_tokenizer()

    def get_tokenizer_group(self):
        """vLLM's ``TokenizerGroup``: ``encode(prompt, ...)`` over the tokenizer."""
        return self.llm_engine.get_tokenizer_group()

    def get_default_sampling_params(self) -> SamplingParams:
        """The defaults every request starts from: the checkpoint's generation config
        as HF ``generate`` reads it (fields a request sets explicitly override them)."""
        return self.llm_engine.get_default_sampling_params()

    def beam_search(
        self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, *, use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Beam search over each prompt (vLLM's entry point): ``params.beam_width``
        beams in the engine, the best ``params.n`` returned per prompt, best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        return self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request)

    def transcribe(
        self,
        audio,
        *,
        language: str | None = None,
        task: str = "transcribe",
        timestamps: bool = False,
        word_timestamps: bool = False,
        sampling_rate: int | None = None,
        use_tqdm: bool = True,
        condition_on_previous_text: bool = False,
        compression_ratio_threshold: float | None = None,
        logprob_threshold: float | None = None,
        no_speech_threshold: float | None = None,
        initial_prompt: str | None = None,
        vad_filter=False,
        vad_parameters: dict | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        **sampling,
    ) -> list:
        """Transcribe (or, ``task="translate"``, translate to English) audio with a model
        that supports transcription (``tandem.core.transcription``), such as Whisper (as
        HF's Whisper ``generate`` does). ``audio``: one input or a list;
        each a file path, samples (array or tensor, with ``sampling_rate``) or
        ``{"audio": ..., "sampling_rate": ...}``, of any length (over 30 s: HF's
        sequential long-form decoding, window by window, inputs concurrently).
        ``language=None`` detects each input's language as HF does.
        ``timestamps=True`` adds segments (start, end, text). ``word_timestamps=True``
        adds ``words`` (``{"word", "start", "end"}``) and each segment's words and token
        timestamps, HF's cross-attention alignment (the checkpoint's ``alignment_heads``).
        ``temperature`` may be a
        sequence for HF's fallback, with ``compression_ratio_threshold`` /
        ``logprob_threshold``; ``condition_on_previous_text`` prompts each window with
        the previous text. ``no_speech_threshold``: a window whose no-speech probability
        is above it and whose average log-probability is below ``logprob_threshold`` (or
        above it alone, without one) is skipped as silence (HF's and faster-whisper's
        rule); each segment then carries its window's ``no_speech_prob``.
        ``initial_prompt``: text the first window is prompted with (faster-whisper's
        name; ``prompt_ids=[...]`` gives it as token ids). ``vad_filter=True``: Silero VAD
        finds each input's speech (``vad_parameters``: faster-whisper's ``VadOptions``
        fields), its regions are joined into chunks of at most 30 s, silence dropped, and
        the chunks are decoded all at once (faster-whisper's batched pipeline), times in
        the input's; ``vad_filter`` may also be a callable ``(waveform, sample_rate) ->
        [(start, end), ...]`` (samples) giving the speech regions itself.
        ``lora_request``: the LoRA adapter every window of every input runs with, or a
        list of one (or None) per input (``enable_lora=True``).
        ``**sampling``: other SamplingParams fields (the rest come
        from the checkpoint's generation config).
        Returns one :class:`tandem.core.transcription.Transcription` per input, in
        order; an input that cannot be served has ``error`` set and the others go on."""
        from tandem.entrypoints.transcribe import transcribe

        return transcribe(
            self, audio, language=language, task=task, timestamps=timestamps, word_timestamps=word_timestamps,
            sampling_rate=sampling_rate,
            use_tqdm=use_tqdm, condition_on_previous_text=condition_on_previous_text,
            compression_ratio_threshold=compression_ratio_threshold, logprob_threshold=logprob_threshold,
            no_speech_threshold=no_speech_threshold, initial_prompt=initial_prompt, vad_filter=vad_filter,
            vad_parameters=vad_parameters, lora_request=lora_request, **sampling,
        )

    @contextmanager
    def session(self) -> Iterator["LLMSession"]:
        """Exclusive use of the engine, to drive requests step by step (what
        ``transcribe`` does: each finished window decides the next request):

        >>> with llm.session() as s:
        ...     rid = s.add_request(prompt, params)
        ...     while s.has_unfinished_requests():
        ...         for out in s.step(): ...

        Other ``generate`` / ``session`` calls wait until the block ends. When it ends
        (an exception included), the session's unfinished requests are aborted and
        their blocks freed, as ``generate`` does. Not reentrant: opening a session (or calling
        ``generate``) inside one on the same thread is a ``RuntimeError``, not a deadlock."""
        self._check_no_session("LLM.session()")
        with self._lock:
            self._session_thread = threading.get_ident()
            s = LLMSession(self.llm_engine, self._ids)
            try:
                yield s
            finally:
                self._session_thread = None
                s._close()

    def _check_no_session(self, what: str) -> None:
        # The lock is not reentrant: waiting for it inside one's own session would wait forever.
        if self._session_thread == threading.get_ident():
            raise RuntimeError(f"{what} inside an LLM.session() block on the same thread: the session holds the "
                               "engine until the block ends; use the session's add_request / step")

    def get_stats(self) -> dict[str, int | float]:
        """Counters since construction: encoder tokens computed and reused, preemptions,
        KV blocks in total and free, requests finished; with ``speculative_config``, draft
        tokens proposed and accepted, the acceptance rate and the mean accepted length."""
        stats = self.llm_engine.get_stats()
        if self._pool is not None:
            # While a call is served (another thread's, or this one's session) its loop alone reads
            # the replicas: their counters are then those their last outputs brought.
            idle = self._lock.acquire(blocking=False)
            try:
                stats = replicas.combined_stats([stats, *self._pool.stats(ask=idle)])
            finally:
                if idle:
                    self._lock.release()
        return stats

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt that fails validation gets an output
        whose ``error`` says why; the other prompts are generated as usual.
        ``lora_request``: a :class:`tandem.LoRARequest` for every prompt, or a list with
        one (or None: the base model) per prompt; the engine needs ``enable_lora=True``
        (without it, a prompt with an adapter gets an output whose ``error`` says so).

        Calls from several threads are served one after another. If the call
        raises or is interrupted, its requests are aborted and their blocks
        freed, so the engine is as it was before the call."""
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        loras = lora_list(lora_request, len(prompts), "prompts")
        self._check_no_session("generate()")
        with self._lock, _heap_frozen():
            return self._run(prompts, params, use_tqdm, loras)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool,
             loras: list[LoRARequest | None]) -> list[RequestOutput]:
        if self._pool is not None and len(prompts) > 1 and self._pool.live():
            return self._run_replicas(prompts, params, use_tqdm, loras)
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            with engine.core.adding():  # one stats snapshot for all of them (linear in the prompts)
                for prompt, p, lora in zip(prompts, params, loras):
                    rid = str(next(self._ids))
                    order.append(rid)
                    try:
                        engine.add_request(rid, prompt, p, lora_request=lora)
                    except EngineDeadError:
                        raise
                    except Exception as e:  # noqa: BLE001 - this prompt alone cannot be served
                        results[rid] = rejected_output(rid, prompt, e, p)
            bar.update(len(results))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        except BaseException:
            engine.abort_request([r for r in order if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in order]

    def _run_replicas(self, prompts: list, params: list[SamplingParams], use_tqdm: bool,
                      loras: list[LoRARequest | None]) -> list[RequestOutput]:
        """``_run`` over the replicas (``replicas.serve_call``): replica 0 is this process's
        engine, stepped here between reads of the others' outputs."""
        import torch

        order = [str(next(self._ids)) for _ in prompts]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, unit="req")

        def on_output(out: RequestOutput) -> None:
            results[out.request_id] = out
            bar.update(1)

        threads = torch.get_num_threads()
        torch.set_num_threads(self._threads_each)  # this process's share, for the call only
        try:
            replicas.serve_call(self._pool, self.engine, list(zip(order, prompts, params, loras)),
                                self.engine.config.max_num_seqs, on_output)
        except BaseException:
            self.engine.abort_request([r for r in order if r not in results and self.engine.core.has_request(r)])
            self._pool.abort()
            raise
        finally:
            torch.set_num_threads(threads)
            bar.close()
        return [results[r] for r in order]


@contextmanager
def _heap_frozen():
    """The objects alive when a call starts (the model's modules, the tokenizer, the
    imported code: some 350,000 for a tiny BART) kept out of the garbage collector's way
    for the call: a full collection walked them all (85 ms each) and a long call's
    allocations set several off (docs/performance.md, issue 49). Collectable again
    after it. Nothing is done when some caller froze the heap already (``tandem serve``
    does), nor collected first: freezing and unfreezing cost nothing whatever the heap."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LLMSession:
    """Requests on an ``LLM``'s engine, from :meth:`LLM.session` (exclusive while open)."""

    def __init__(self, engine: LLMEngine, ids) -> None:
        self._engine, self._ids = engine, ids
        self._unfinished: set[str] = set()
        self._open = True

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, *,
                    prompt_slot: "PromptSlot | None" = None, lora_request: LoRARequest | None = None) -> str:
        """Queue a request; returns its id. ``ValueError`` / ``TypeError`` name what is
        wrong with it (nothing is queued). ``params=None``: the generation config's defaults.
        ``lora_request``: the adapter it runs with (None: the base model)."""
        if not self._open:
            raise RuntimeError("this LLM session has ended: open a new one with LLM.session()")
        rid = str(next(self._ids))
        self._engine.add_request(rid, prompt, params, prompt_slot=prompt_slot, lora_request=lora_request)
        self._unfinished.add(rid)
        return rid

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of this session's requests that advanced."""
        if not self._open:
            raise RuntimeError("this LLM session has ended: open a new one with LLM.session()")
        outs = self._engine.step()
        for out in outs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        return outs

    def has_unfinished_requests(self) -> bool:
        # The engine's answer too: while the session is open, its requests are the engine's only ones.
        return bool(self._unfinished) and self._engine.has_unfinished_requests()

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._engine.abort_request(ids)
        self._unfinished.difference_update(ids)

    def _close(self) -> None:
        self._open = False
        if self._unfinished:
            self._engine.abort_request(sorted(self._unfinished))
            self._unfinished.clear()


_PROMPT_FORMS = (
    "a str (the encoder text), {'prompt': str}, {'prompt_token_ids': [int, ...]}, "
    "{'encoder_prompt': ..., 'decoder_prompt': ...}, or a list of these"
)


def _prompt_list(prompts) -> list:
    """One prompt or a list of them; anything else is a ``TypeError`` listing the accepted forms.

    Elements of a list are checked per request (a bad one gets an output with ``error``)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            raise TypeError(
                f"prompts is a bare list of ints ({preview(prompts)}); token ids go in a dict: "
                f"{{'prompt_token_ids': {preview(prompts)}}} (or a list of such dicts)"
            )
        return list(prompts)
    raise TypeError(f"prompts must be {_PROMPT_FORMS}; got {type(prompts).__name__}: {preview(prompts)}")


def _params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)] * n
    if isinstance(sampling_params, SamplingParams):
        return [_final_only(sampling_params)] * n
    if not isinstance(sampling_params, (list, tuple)):
        hint = "; build one with SamplingParams(**...)" if isinstance(sampling_params, dict) else ""
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them, got "
            f"{type(sampling_params).__name__}: {preview(sampling_params)}{hint}"
        )
    bad = [(i, p) for i, p in enumerate(sampling_params) if not isinstance(p, SamplingParams)]
    if bad:
        i, p = bad[0]
        raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}: {preview(p)}")
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts; pass one, or one per prompt")
    return [_final_only(p) for p in sampling_params]


def _final_only(params: SamplingParams) -> SamplingParams:
    # generate() returns each request once, finished: no per-step outputs to build.
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return params.replace(output_kind=RequestOutputKind.FINAL_ONLY)
