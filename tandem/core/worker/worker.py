"""The worker: the model, its KV caches, the runner and the sampler.

It runs a ``SchedulerOutput`` (plain data) and answers a ``ModelRunnerOutput``:
swaps and copy-on-write copies first, through the attention backend's own
cache ops, then the forward pass and sampling. What it keeps across steps is
keyed by request and sequence id: each request's sampling parameters and a
seeded request's generators, one per sequence (so each completion keeps its random
stream through preemption, whatever the others do),
and the persistent block tables in the runner.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace

import torch

from tandem.core.attention import AttentionBackend, KVCacheSpec
from tandem.core.config import EngineConfig
from tandem.core.faults import KVTransferError
from tandem.core.layers import lm_head_screen
from tandem.core.layers.kernel_setup import prepare_linear_kernels
from tandem.core.layers.parallel_state import TensorParallelGroup, tensor_parallel
from tandem.core.worker.host_malloc import keep_freed_memory
from tandem.core.loader import load_model
from tandem.core.model import EncoderDecoderModel
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler_output import ModelRunnerOutput, SamplingInputs, SchedulerOutput
from tandem.core.kv_compress_config import PER_HEAD_FEATURE
from tandem.core.worker.cross_compress import CrossKVCompressor
from tandem.core.worker.greedy_screen import MAX_ROWS as SCREEN_MAX_ROWS, ScreenStats, StepScreen
from tandem.core.worker.token_histories import TokenHistories
from tandem.core.worker.logits_processors import ProcessorRows, needs_history, only_bans
from tandem.core.worker.compiled_step import CompiledDecodeStep
from tandem.core.worker.piecewise_backend import cuda_graph_decode_step
from tandem.core.worker.model_runner import ModelRunner
from tandem.core.worker.sampler import Sampler

logger = logging.getLogger(__name__)


def seeded_stream(seed: int, index: int) -> torch.Generator:
    """The random stream of completion ``index`` of a request seeded with ``seed``: the
    seed itself for the first (a request with ``n=1`` draws as it always did), a hash of
    both for the others. Each completion draws from its own stream, so its samples do not
    depend on how many steps the others run (one stopped by a string runs on until the
    frontend's stop reaches the core) or on how many draft tokens they verify."""
    if index:
        seed = int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(seed)


@dataclass
class _RequestState:
    params: SamplingParams
    # A seeded request's streams, by sequence id (None: it draws from the engine's).
    generators: dict[int, torch.Generator] | None
    keeps_history: bool  # its processors read past tokens

    def stream(self, seq_id: int) -> torch.Generator:
        """A sequence the request did not have when it was first scheduled (a beam's: a
        sampling request starts with all of its own) gets the next completion's stream."""
        gen = self.generators[seq_id] = seeded_stream(self.params.seed, len(self.generators))
        return gen


def _number_cross_layers(model: torch.nn.Module, num_layers: int) -> None:
    """kv_compress per head: each cross-attention layer's impl learns its decoder layer
    index (``AttentionImpl.layer_index``), in module order, which is the order the model
    passes the per-layer caches in (the observation relies on it too)."""
    from tandem.core.attention import AttentionType
    from tandem.core.layers.attention import Attention

    cross = [m for m in model.modules() if isinstance(m, Attention) and m.attn_type is AttentionType.ENCODER_DECODER]
    if len(cross) != num_layers:
        raise RuntimeError(f"kv_compress per head: the model has {len(cross)} cross-attention layers, its cache "
                           f"{num_layers}")
    for i, layer in enumerate(cross):
        layer.impl.layer_index = i


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        model_cls: type[EncoderDecoderModel],
        attn_backend: type[AttentionBackend],
        eos_token_ids: list[int],
        tp: TensorParallelGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``tp``: this worker's tensor-parallel rank (None: the whole model, one rank);
        ``device``: where it runs (default: the config's)."""
        self.config = config
        self.hf_config = hf_config
        self.model_cls = model_cls
        self.backend = attn_backend
        self.tp = tp or TensorParallelGroup()
        self.device, self.dtype = device or config.torch_device, config.torch_dtype
        self.kv_dtype = config.kv_cache_torch_dtype  # the compute dtype, or fp8 (kv_cache_dtype)
        self.block_size = config.block_size
        spec = model_cls.kv_cache_spec(hf_config)
        if self.tp.size > 1:  # this rank's heads (a KV head is replicated where there are fewer than ranks)
            spec = replace(spec, num_kv_heads=max(1, spec.num_kv_heads // self.tp.size))
        self.kv_spec: KVCacheSpec = spec
        self.sampler = Sampler(eos_token_ids, config.seed, self.device)
        self.requests: dict[str, _RequestState] = {}
        # Decoder tokens of the sequences whose processors read them, by seq id.
        self.histories = TokenHistories(config.max_num_seqs, 64)
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] | None = None  # made on the first swap-out
        self.num_cpu_blocks = 0
        self.model: EncoderDecoderModel | None = None
        self.runner: ModelRunner | None = None
        self.lora = None  # tandem.lora.manager.LoRAManager when enable_lora (load_model makes it)
        self.has_lm_head_screen = False  # whether an LM head has an int8 screen (load_model)
        self.screen_stats = ScreenStats()
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across every layer, in the backend's own layout."""
        s = self.kv_spec
        return s.num_layers * self.backend.kv_cache_block_bytes(self.block_size, s.num_kv_heads, s.head_size, self.kv_dtype)

    def load_model(self) -> None:
        # Before the weights: loading allocates them, and every step's tensors follow.
        self.host_malloc = (keep_freed_memory(self.config.cpu_malloc) if self.device.type == "cpu"
                            else "host malloc: system settings (device is not cpu)")
        if self.tp.size == 1:
            self.model = load_model(self.model_cls, self.hf_config, self.config.model_path, self.backend, self.dtype,
                                    self.device)
        else:
            with tensor_parallel(self.tp.size, self.tp.rank, self.tp.group):
                self.model = load_model(self.model_cls, self.hf_config, self.config.model_path, self.backend,
                                        self.dtype, self.device)
        self.linear_kernels = prepare_linear_kernels(
            self.model, device=self.device, dtype=self.dtype, gemm=self.config.cpu_gemm,
            quantization=self.config.quantization, batch_hint=min(self.config.max_num_seqs, 128),
            screen=self.config.lm_head_screen if self.tp.size == 1 else "off",
        )
        self.has_lm_head_screen = any(getattr(m, "screen_head", None) is not None for m in self.model.modules())
        self.lora = None
        if self.config.enable_lora:
            from tandem.lora.manager import LoRAManager

            c = self.config
            # In the model's dtype; float32 over int8 GEMMs (int8 computes in float32).
            self.lora = LoRAManager(self.model, max_loras=c.max_loras, max_rank=c.max_lora_rank,
                                    max_cpu_loras=c.max_cpu_loras, dtype=self.dtype, device=self.device)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the device pool (one tensor per decoder layer) and build the runner."""
        s = self.kv_spec
        self.kv_caches = [
            self.backend.allocate_kv_cache(num_blocks, self.block_size, s.num_kv_heads, s.head_size, self.kv_dtype, self.device)
            for _ in range(s.num_layers)
        ]
        self.num_cpu_blocks = num_cpu_blocks
        builder = self.backend.get_metadata_builder_cls()(self.block_size, self.device, s)
        max_blocks = -(-self.model_cls.max_decoder_len(self.hf_config) // self.block_size)
        compress = self.config.kv_compress_config
        # Per head where the backend reads that layout, else one count per request.
        per_head = compress is not None and not self.backend.feature_reasons(frozenset({PER_HEAD_FEATURE}))
        self.cross_compress = (CrossKVCompressor(s.num_layers, s.num_kv_heads, self.block_size, per_head=per_head,
                                                 min_keep=compress.min_keep)
                               if compress is not None else None)
        if per_head:
            _number_cross_layers(self.model, s.num_layers)
        self.runner = ModelRunner(self.model, builder, self.block_size, self.device, self.config.max_num_seqs, max_blocks,
                                  cross_compress=self.cross_compress, compiled=self._compiled_step())
        self.runner.lora = self.lora

    def _compiled_step(self) -> CompiledDecodeStep | None:
        """The compiled decode step where ``enforce_eager`` is off and it can serve, else None
        (the reason logged once, in the start line's terms)."""
        c = self.config
        if c.enforce_eager:
            return None
        why = []
        if self.device.type not in ("cpu", "cuda"):
            why.append(f"device {self.device.type}: compiled steps are built for CPU and CUDA only")
        if self.tp.size > 1:
            why.append("tensor parallelism: the ranks' collectives run eager")
        if c.enable_lora:
            why.append("enable_lora: adapters switch per step")
        if why:
            logger.info("enforce_eager=False, but decode steps run eager: %s", "; ".join(why))
            return None
        kwargs = dict(max_rows=min(c.compile_max_batch_size, c.max_num_seqs), cache_dir=c.compile_cache_dir)
        if self.device.type == "cuda":
            step = cuda_graph_decode_step(self.model, self.device, **kwargs)
            if step.kernels:  # a packed kernel reads the step's real rows in Python: a graph would fix them
                logger.info("enforce_eager=False, but decode steps run eager: pre-packed linear kernels on %s",
                            self.device)
                return None
            logger.info("decode steps: CUDA graphs, piecewise around attention (batch buckets %s, cache %s)",
                        step.buckets, step.cache_dir)
            return step
        step = CompiledDecodeStep(self.model, self.device, **kwargs)
        logger.info("decode steps compile (batch buckets %s, cache %s)", step.buckets, step.cache_dir)
        return step

    # -- the step --------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput, sampling: SamplingInputs | None = None) -> ModelRunnerOutput | None:
        """Apply the step's swaps and copies, run the scheduled sequences, sample.
        ``sampling``: the modes' logits transforms, applied to the raw logits first.
        Returns None when nothing was scheduled."""
        if out.blocks_to_copy_first:  # first of all: the K/V as the last step left it
            src, dst = self._ids(out.blocks_to_copy_first, self.device)
            self.backend.copy_blocks(self.kv_caches, src, dst)
        if out.seq_copies:  # before the forgets: a copied sequence may be finished since
            self._copy_seqs(out.seq_copies)
        self._update_states(out)
        # First: a re-pack reads blocks the step's swaps, copies or forward may reuse.
        for repack in out.cross_repacks:
            self.cross_compress.repack(repack, self.kv_caches)
        # Per head: the blocks each re-packed table still needs, for the scheduler to free
        # the rest (one rank only: under tensor parallelism each rank chooses for its heads).
        needed = {}
        if out.cross_repacks and self.cross_compress.per_head and self.tp.size == 1:
            needed = {r.request_id: n for r in out.cross_repacks
                      if (n := self.cross_compress.blocks_needed(r.request_id)) is not None}  # None: one count
        try:
            if out.blocks_to_swap_out:
                self._swap(out.blocks_to_swap_out, to_cpu=True)
            if out.blocks_to_swap_in:
                self._swap(out.blocks_to_swap_in, to_cpu=False)
        except Exception as e:  # the swapped-out requests' CPU copies may be torn
            raise KVTransferError(f"swapping KV blocks failed: {type(e).__name__}: {e}") from e
        # After the swaps: a copy may read a block just swapped in, or write one
        # a swap-out just vacated.
        if out.blocks_to_copy:
            src, dst = self._ids(out.blocks_to_copy, self.device)
            self.backend.copy_blocks(self.kv_caches, src, dst)
        if not out.scheduled:
            return None
        # A request whose adapter cannot be served runs on the base weights this step and
        # fails with the reason (every rank decides alike: same adapters, same order).
        lora_slots, lora_failed = self.lora.assign(out.scheduled) if self.lora is not None else ({}, {})
        if self.tp.rank:  # every rank computes the forward pass (its collectives); rank 0 samples
            with torch.inference_mode():
                self.runner.execute(out, self.kv_caches, lora_slots)
            return None
        # Per row: (params, generator, output tokens so far, length, seq id, request id,
        # joint), one tuple a row, transposed once below (not seven appends a row).
        row_data: list[tuple] = []
        add = row_data.append
        modes = []  # (request id, its StepMode, its rows)
        history = []  # sequences whose processors read their past tokens
        history_rows = []
        requests = self.requests
        for group in out.scheduled:
            rid, mode = group.request_id, group.mode
            state = requests[rid]
            p, gens, joint_rows = state.params, state.generators, mode is not None and mode.joint_rows
            gen = None
            start = len(row_data)
            for seq in group.seqs:
                if gens is not None:
                    gen = gens.get(seq.seq_id) or state.stream(seq.seq_id)
                # One row per position whose logits are returned (several when lookahead
                # tokens are verified), each with the lengths it would have in plain decoding.
                end = seq.num_computed_tokens + len(seq.token_ids)
                n = seq.num_logits
                if n == 1:
                    add((p, gen, seq.num_output_tokens, end, seq.seq_id, rid, joint_rows))
                else:
                    for j in range(n - 1, -1, -1):
                        add((p, gen, seq.num_output_tokens + n - 1 - j, end - j, seq.seq_id, rid, joint_rows))
                if state.keeps_history:
                    history.append(seq)
                    history_rows.append(len(row_data) - 1)  # its last row (a run's rows have one)
            if mode is not None:
                modes.append((rid, mode, list(range(start, len(row_data)))))
        if history:
            self._record_histories(history)
        params, generators, num_out, seq_lens, seq_ids, row_request, joint = (
            [list(column) for column in zip(*row_data)] if row_data else [[] for _ in range(7)])
        rows = self._processor_rows(params, num_out, seq_lens, seq_ids, joint)
        screen = self._screen(params, modes, sampling)
        with torch.inference_mode():
            with lm_head_screen.screening(screen):
                logits = self.runner.execute(out, self.kv_caches, lora_slots)
            if sampling is not None:  # before everything else reads the logits
                self._transform(logits, sampling, seq_ids, num_out)
            prepared = _by_class(modes, lambda cls, idx: cls.prepare_all(
                logits, [(modes[j][1], modes[j][2]) for j in idx]))
            claimed = sorted([i for *_, mode_rows in modes for i in mode_rows])
            sampled = self.sampler(logits, rows, generators, claimed, screen)
            if screen is not None:
                self.screen_stats.add(screen)
            selected = _by_class(modes, lambda cls, idx: cls.select_all(
                sampled.scores,
                [(modes[j][1], modes[j][2], params[modes[j][2][0]], prepared[j], [generators[i] for i in modes[j][2]])
                 for j in idx],
                self.sampler.generator))
            mode_outputs = {rid: result for (rid, _, _), result in zip(modes, selected)}
        plain_ids = seq_ids
        if claimed:
            claimed_set = set(claimed)
            plain_ids = [s for i, s in enumerate(seq_ids) if i not in claimed_set]
        failed = {**lora_failed, **{row_request[i]: why for i, why in sampled.failed_rows.items()}}
        no_token = frozenset(seq_ids[i] for i in sampled.no_token_rows)
        run_tokens = []
        if (out.num_steps > 1 and not modes and not failed and not no_token
                and (sampling is None or not sampling.transforms)):
            run_tokens = self._run_steps(out, rows, seq_ids, generators, screen, sampled.token_ids,
                                         [s.seq_id for s in history], history_rows, lora_slots)
        return ModelRunnerOutput(
            plain_ids, sampled.token_ids, sampled.logprobs, sampled.top_logprobs, mode_outputs, failed, no_token,
            cross_blocks_needed=needed, run_token_ids=run_tokens,
        )

    def _run_steps(self, out: SchedulerOutput, rows: ProcessorRows, seq_ids: list[int], generators, screen,
                   tokens: list[int], hist_ids: list[int], hist_rows: list[int], lora_slots) -> list[list[int]]:
        """The steps after the first of a run (``SchedulerOutput.num_steps``; every row a
        plain decode of one sequence): each feeds the last one's tokens, its rows one
        token longer, their histories holding the tokens so far. A step whose sampling
        fails a row or finds no token for one is dropped, and the run ends before it:
        the next schedule's step meets the same and reports it. Returns each kept
        step's tokens. ``hist_ids`` / ``hist_rows``: the sequences whose processors read
        their past tokens, and their rows."""
        h = self.histories
        num_out, seq_lens, params, joint = rows.num_output_tokens, rows.seq_lens, rows.params, rows.joint
        kept = []
        for _ in range(out.num_steps - 1):
            if hist_ids:  # outside inference mode, as _record_histories writes them (the tensors stay normal)
                h.advance(hist_ids, [tokens[r] for r in hist_rows])
            num_out = [k + 1 for k in num_out]
            seq_lens = [k + 1 for k in seq_lens]
            step_rows = self._processor_rows(params, num_out, seq_lens, seq_ids, joint)
            if screen is not None:  # a screen serves one step: each of the run's gets its own
                screen = self._screen(params, [], None)
            with torch.inference_mode():
                with lm_head_screen.screening(screen):
                    logits = self.runner.execute_next(torch.tensor(tokens, dtype=torch.long), self.kv_caches,
                                                      out, lora_slots)
                sampled = self.sampler(logits, step_rows, generators, None, screen)
            if screen is not None:
                self.screen_stats.add(screen)
            if sampled.failed_rows or sampled.no_token_rows:
                break
            tokens = sampled.token_ids
            kept.append(tokens)
        return kept

    def _screen(self, params: list[SamplingParams], modes, sampling: SamplingInputs | None) -> StepScreen | None:
        """A screen for a step whose rows are all plain greedy (no mode, no logits
        transform, no logprobs, processors that only ban), few enough for it to pay."""
        if (not self.has_lm_head_screen or modes or (sampling is not None and sampling.transforms)
                or not 0 < len(params) <= SCREEN_MAX_ROWS):
            return None
        seen = set()
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if not p.greedy or p.logprobs is not None or not only_bans(p):
                return None
        return StepScreen() if self.screen_stats.wanted() else None

    @staticmethod
    def _transform(logits: torch.Tensor, sampling: SamplingInputs, seq_ids: list[int], num_out: list[int]) -> None:
        rows_of: dict[int, list[int]] = {}
        for i, s in enumerate(seq_ids):
            rows_of.setdefault(s, []).append(i)
        for t in sampling.transforms:
            rows, owners = [], []
            for j, s in enumerate(t.seq_ids):
                for i in rows_of.get(s, ()):
                    rows.append(i)
                    owners.append(j)
            if rows:
                t.apply(logits, rows, owners, [num_out[i] for i in rows])

    def _record_histories(self, seqs) -> None:
        """Add the step's tokens to each sequence's history (``TokenHistories.record``: a
        steady decode step as one tensor write); new, forked and recomputed ones one by one."""
        self.histories.record(seqs, self._record_history)

    def _record_history(self, seq) -> None:
        """A sequence ``_record_histories`` could not extend: new, forked or recomputed."""
        h = self.histories
        if seq.prefix_token_ids is not None:
            h.set(seq.seq_id, list(seq.prefix_token_ids) + list(seq.token_ids))
        elif seq.num_computed_tokens == 0:
            h.set(seq.seq_id, list(seq.token_ids))
        elif seq.seq_id in h:  # recomputed part of the way (kept tokens beyond)
            h.set(seq.seq_id, h.get(seq.seq_id)[: seq.num_computed_tokens] + list(seq.token_ids))
        else:
            raise RuntimeError(f"sequence {seq.seq_id}: no token history and no prefix to start one")

    def _copy_seqs(self, copies: list[tuple[int, int, int, list[int]]]) -> None:
        """Sequences that took another's place (``SchedulerOutput.seq_copies``): their
        block tables, and the token histories of those whose source keeps one."""
        self.runner.copy_seqs(copies)
        h = self.histories
        held = h.keys()
        pairs = [(c[0], c[1]) for c in copies if c[0] in held]
        if pairs:
            src, dst = zip(*pairs)
            h.copy_rows(src, dst)

    def _processor_rows(self, params, num_out: list[int], seq_lens: list[int], seq_ids: list[int],
                        joint) -> ProcessorRows:
        """A step's ``ProcessorRows``, its histories read from ``self.histories``."""
        return ProcessorRows(params, num_out, seq_lens,
                             lambda idx: self._histories([seq_ids[i] for i in idx], [seq_lens[i] for i in idx]),
                             joint, lambda idx: self.histories.view(seq_ids, seq_lens, idx))

    def _histories(self, seq_ids: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' decoder tokens, each row's first ``lengths[i]`` (a verified draft
        position sees the tokens before it, not the drafts after)."""
        h = self.histories
        rows = torch.tensor(h.rows(seq_ids), dtype=torch.long)
        lengths = torch.tensor(lengths, dtype=torch.long)
        return h.gather(rows, int(lengths.max())), lengths

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self.requests.pop(rid, None)
            self.runner.forget_request(rid)
            if self.cross_compress is not None:
                self.cross_compress.forget(rid)
        self.runner.forget_seqs(out.finished_seq_ids)
        for seq_id in out.finished_seq_ids:
            self.histories.remove(seq_id)
        for new in out.new_requests:
            p = new.sampling_params
            gens = None if p.seed is None else {sid: seeded_stream(p.seed, i) for i, sid in enumerate(new.seq_ids)}
            self.requests[new.request_id] = _RequestState(p, gens, needs_history(p))

    @staticmethod
    def _ids(pairs: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        return src, dst

    def _swap(self, mapping: list[tuple[int, int]], to_cpu: bool) -> None:
        if self.swap_caches is None:
            s = self.kv_spec
            # Uncommitted, not zeroed: the OS commits a page when a swapped block
            # first lands on it, so swap_space costs memory only as it is used.
            self.swap_caches = [
                self.backend.allocate_kv_cache(
                    self.num_cpu_blocks, self.block_size, s.num_kv_heads, s.head_size, self.kv_dtype, "cpu", zeroed=False
                )
                for _ in range(s.num_layers)
            ]
        src_ids, dst_ids = self._ids(mapping, "cpu")
        for dev_cache, cpu_cache in zip(self.kv_caches, self.swap_caches):
            src, dst = (dev_cache, cpu_cache) if to_cpu else (cpu_cache, dev_cache)
            self.backend.swap_blocks(src, dst, src_ids, dst_ids)
        if to_cpu:
            self.swapped_out_blocks += len(mapping)
        else:
            self.swapped_in_blocks += len(mapping)


def _by_class(modes: list, call) -> list:
    """``call(cls, indices)`` once per run of consecutive ``modes`` (``(request id, mode,
    rows)``) of one StepMode class, with the run's indices; the results, in ``modes``'
    order. Runs, not classes: modes that draw from the engine's generator draw in the
    order they always did."""
    results: list = []
    start = 0
    while start < len(modes):
        cls = type(modes[start][1])
        end = start + 1
        while end < len(modes) and type(modes[end][1]) is cls:
            end += 1
        results.extend(call(cls, list(range(start, end))))
        start = end
    return results
