"""The engine: requests in, one scheduled forward pass per step, outputs out."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.core.attention import AttentionType
from tandem.core.block_manager import BlockManager, Device, blocks_for
from tandem.core.config import DEFAULT_KV_CACHE_GIB, EngineConfig
from tandem.core.inputs import EncoderDecoderInputs, InputProcessor, PromptType
from tandem.core.loader import check_model_config, load_hf_config, load_model, load_tokenizer
from tandem.core.memory import GiB, check_fits
from tandem.core.model_runner import ModelRunner
from tandem.core.output_processor import OutputProcessor
from tandem.core.outputs import RequestOutput
from tandem.core.sampler import Sampler
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from tandem.registry import AttentionBackendRegistry, ModelRegistry

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    preemptions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    num_requests_finished: int = 0


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model_registry: "ModelRegistry", backend_registry: "AttentionBackendRegistry"
    ) -> None:
        """The registries come from the caller (``LLM`` fills them from the plugins)."""
        self.config = config
        self.scheduler_config = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode
        )

        trust = config.trust_remote_code
        self.hf_config = load_hf_config(config.model, trust_remote_code=trust)
        self.model_cls, self.architecture = model_registry.resolve(getattr(self.hf_config, "architectures", None))
        device, dtype = config.torch_device, config.torch_dtype
        # Before anything is built from it: sizes, head divisibility, parameters vs weights and memory.
        check_model_config(self.model_cls, self.hf_config, config.model, dtype, device)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, trust_remote_code=trust)
        spec = self.model_cls.kv_cache_spec(self.hf_config)
        self.attn_backend = backend_registry.select(
            config.attention_backend, device, dtype, spec.head_size, frozenset(AttentionType)
        )
        shape_of = self.attn_backend.get_kv_cache_shape
        per_block = spec.num_layers * 2 * config.block_size * spec.num_kv_heads * spec.head_size
        block_bytes = per_block * torch.empty((), dtype=dtype).element_size()
        num_blocks = config.num_kv_blocks or self._default_num_blocks(spec, block_bytes)
        num_cpu_blocks = int(config.swap_space * GiB // block_bytes)
        self._check_pool_memory(num_blocks * block_bytes, num_cpu_blocks * block_bytes, device)
        self.model = load_model(self.model_cls, self.hf_config, config.model, self.attn_backend, dtype, device)

        self._cache_shape = lambda n: shape_of(n, config.block_size, spec.num_kv_heads, spec.head_size)
        self.kv_caches = [
            torch.zeros(self._cache_shape(num_blocks), dtype=dtype, device=device)
            for _ in range(spec.num_layers)
        ]
        self._swap_caches: list[torch.Tensor] | None = None  # created on the first swap-out
        self._num_layers = spec.num_layers

        self.block_manager = BlockManager(config.block_size, num_blocks, num_cpu_blocks)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        builder = self.attn_backend.get_metadata_builder_cls()(config.block_size, device, spec)
        self.runner = ModelRunner(self.model, builder, config.block_size, device)
        eos = self.hf_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.sampler = Sampler(sorted(self.eos_token_ids), config.seed, device)
        self.input_processor = InputProcessor(self.hf_config, self.model_cls, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = self.model_cls.vocab_size(self.hf_config)
        self._seq_ids = itertools.count()
        self.groups: dict[str, SequenceGroup] = {}
        self.stats = EngineStats()
        logger.info(
            "engine ready: %s for %s, %s on %s; attention backend %s (%s); KV pool %d blocks x %d "
            "tokens = %.1f MiB; swap space %d blocks = %.2f GiB, committed as used",
            self.model_cls.__name__, self.architecture, str(dtype).removeprefix("torch."), device,
            self.attn_backend.name, self._backend_reason(), num_blocks, config.block_size,
            num_blocks * block_bytes / (1 << 20), num_cpu_blocks, num_cpu_blocks * block_bytes / GiB,
        )

    def _backend_reason(self) -> str:
        from tandem.registry.backends import _PREFERENCE, ENV_VAR

        if self.config.attention_backend:
            return "asked for by attention_backend"
        if os.environ.get(ENV_VAR):
            return f"asked for by ${ENV_VAR}"
        return f"the first of {', '.join(_PREFERENCE)}, then others, that can serve this device and dtype"

    def _check_pool_memory(self, kv_bytes: int, swap_bytes: int, device: torch.device) -> None:
        c = self.config
        pool = f"num_kv_blocks={c.num_kv_blocks}" if c.num_kv_blocks else f"kv_cache_memory={c.kv_cache_memory}"
        if device.type == "cpu":  # both pools live in host RAM
            what = f"the KV pool ({pool}) + swap_space={c.swap_space}"
            check_fits(what, kv_bytes + swap_bytes, device, "lower them")
        else:
            check_fits(f"the KV pool ({pool})", kv_bytes, device, "lower it")
            check_fits(f"swap_space={c.swap_space}", swap_bytes, torch.device("cpu"), "lower it")

    def _default_num_blocks(self, spec, block_bytes: int) -> int:
        config, m, cfg = self.config, self.model_cls, self.hf_config
        if config.kv_cache_memory is not None:
            return max(1, int(config.kv_cache_memory * GiB // block_bytes))
        # Enough for max_num_seqs requests of the longest encoder and decoder the
        # model allows (plus the watermark), but no more than the default memory.
        per_request = blocks_for(m.max_encoder_len(cfg), config.block_size) + blocks_for(
            m.max_decoder_len(cfg), config.block_size
        )
        wanted = int(config.max_num_seqs * per_request * 1.02) + 1
        return max(1, min(wanted, int(DEFAULT_KV_CACHE_GIB * GiB // block_bytes)))

    # -- requests ------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises ``ValueError`` naming what is wrong."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        inputs = self.input_processor.process(prompt)
        self._validate(inputs, params)
        enc = Sequence(next(self._seq_ids), inputs.encoder_prompt_token_ids)
        seqs = [Sequence(next(self._seq_ids), inputs.prompt_token_ids) for _ in range(params.n)]
        group = SequenceGroup(
            request_id, enc, seqs, params, time.monotonic(), inputs.encoder_prompt, inputs.prompt
        )
        # Every sequence at full length must fit the pool, or it would preempt itself
        # forever (blocks its sequences share count once; the cross table always counts).
        need = self.block_manager.blocks_needed(group, extra_tokens=params.max_tokens)
        usable = self.block_manager.usable_blocks
        if need > usable:
            raise ValueError(
                f"request needs up to {need} KV blocks but the pool has {usable}; "
                "raise num_kv_blocks or kv_cache_memory, or lower max_tokens"
            )
        self.groups[request_id] = group
        self.output_processor.add_request(group)
        self.scheduler.add(group)

    def max_new_tokens(self, prompt: PromptType) -> int:
        """Tokens the model's decoder positions leave after this prompt's decoder prompt;
        raises ``ValueError`` or ``TypeError`` for a prompt ``add_request`` would reject."""
        inputs = self.input_processor.process(prompt)
        return self.model_cls.max_decoder_len(self.hf_config) - len(inputs.prompt_token_ids)

    def _validate(self, inputs: EncoderDecoderInputs, params: SamplingParams) -> None:
        cfg, m = self.hf_config, self.model_cls
        for where, ids in (("encoder prompt", inputs.encoder_prompt_token_ids), ("decoder prompt", inputs.prompt_token_ids)):
            bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
            if bad:
                i, t = bad[0]
                raise ValueError(
                    f"{where} token id {t} at position {i} is outside the vocabulary [0, {self.vocab_size})"
                )
        enc_len, dec_len = len(inputs.encoder_prompt_token_ids), len(inputs.prompt_token_ids)
        if enc_len > m.max_encoder_len(cfg):
            raise ValueError(
                f"encoder prompt has {enc_len} tokens; the model accepts at most {m.max_encoder_len(cfg)}"
            )
        if dec_len + params.max_tokens > m.max_decoder_len(cfg):
            raise ValueError(
                f"decoder prompt ({dec_len} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's {m.max_decoder_len(cfg)} decoder positions"
            )
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(
                f"SamplingParams.logprobs={params.logprobs} exceeds the vocabulary size ({self.vocab_size})"
            )
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(
                f"SamplingParams.stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if params.n > self.scheduler_config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.scheduler_config.max_num_seqs}")
        # A group preempted by recompute runs its encoder and every decoder token
        # again in one step, so the worst case must fit the step's token budget.
        worst = enc_len + params.n * (dec_len + params.max_tokens - 1)
        budget = self.scheduler_config.max_num_batched_tokens
        if worst > budget:
            raise ValueError(
                f"request may need {worst} tokens in one step (encoder {enc_len} + n={params.n} x "
                f"(decoder prompt {dec_len} + max_tokens {params.max_tokens} - 1), when recomputed "
                f"after preemption); max_num_batched_tokens={budget}"
            )

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Drop the requests and free their blocks; returns their (aborted) outputs."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        found = self.scheduler.abort(ids)
        # A request caught between queues (an exception or interrupt inside
        # schedule()) is in none of them: free it through the engine's own list.
        queued = {g.request_id for g in found}
        for rid in ids & self.groups.keys() - queued:
            group = self.groups[rid]
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.block_manager.free_group(group)
            found.append(group)
        outs = [self.output_processor.make_output(self.groups.pop(g.request_id)) for g in found]
        if not self.groups:
            self._reclaim_leaked_blocks()
        return outs

    def _reclaim_leaked_blocks(self) -> None:
        """With no request left, every block must be free; take back any that are not."""
        bm = self.block_manager
        leaked = {d.value: bm.num_total_blocks(d) - bm.num_free_blocks(d) for d in Device}
        if any(leaked.values()):
            logger.warning("no request is left but blocks are held (%s); resetting the pools", leaked)
            bm.reset()
        self.scheduler.clear()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    def get_stats(self) -> dict[str, int]:
        bm, sch = self.block_manager, self.scheduler
        return {
            "encoder_tokens_computed": sch.encoder_tokens_computed,
            "encoder_tokens_reused": sch.encoder_tokens_reused,
            "num_preemptions": self.stats.preemptions,
            "kv_blocks_total": bm.num_total_blocks(),
            "kv_blocks_free": bm.num_free_blocks(),
            "swapped_out_blocks": self.stats.swapped_out_blocks,
            "swapped_in_blocks": self.stats.swapped_in_blocks,
            "num_requests_finished": self.stats.num_requests_finished,
            "num_requests_unfinished": sch.num_unfinished(),
        }

    # -- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass. Returns an output for every request that
        advanced, as its ``output_kind`` asks: everything so far, only what is new,
        or (``FINAL_ONLY``) nothing until it finishes."""
        sched = self.scheduler.schedule()
        self.stats.preemptions += sched.preempted
        if sched.blocks_to_swap_out:
            self._swap(sched.blocks_to_swap_out, to_cpu=True)
        if sched.blocks_to_swap_in:
            self._swap(sched.blocks_to_swap_in, to_cpu=False)
        # After the swaps: a copy may read a block just swapped in, or write one
        # a swap-out just vacated.
        if sched.blocks_to_copy:
            self._copy_blocks(sched.blocks_to_copy)
        if not sched.scheduled:
            if not (sched.blocks_to_swap_out or sched.blocks_to_swap_in):
                self._no_progress()
            return []
        owners = [meta.group for meta in sched.scheduled for _ in meta.seqs]
        with torch.inference_mode():
            logits, seqs = self.runner.execute(sched.scheduled, self.kv_caches)
            sampled = self.sampler(logits, seqs, owners)

        # Sharers too: their cross table was filled by now, in this step or an earlier one.
        for meta in sched.scheduled:
            meta.group.encoder_computed = True
        for i, (seq, group) in enumerate(zip(seqs, owners)):
            seq.num_computed_tokens = len(seq)
            seq.append_token(sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
            self._check_stop(seq, group)
        return self._process_outputs(sched.scheduled)

    def _process_outputs(self, scheduled) -> list[RequestOutput]:
        """Stop strings and outputs for every group that advanced; free what finished."""
        outputs = []
        for meta in scheduled:
            group = meta.group
            out = self.output_processor.process(group, {seq.seq_id: 1 for seq in meta.seqs})
            for seq in meta.seqs:
                if seq.finished:
                    self.block_manager.free(seq, group)
            if group.is_finished:
                self.scheduler.finish(group)
                del self.groups[group.request_id]
                self.stats.num_requests_finished += 1
            if out is not None:
                outputs.append(out)
        return outputs

    def _no_progress(self) -> None:
        """Requests wait, nothing runs and nothing was admitted: every later step would
        do the same, so say why instead of spinning."""
        sch, bm = self.scheduler, self.block_manager
        if not sch.waiting or sch.running or sch.swapped:
            return
        head = sch.waiting[0]
        raise RuntimeError(
            f"the scheduler cannot admit request {head.request_id!r} although nothing runs: it needs "
            f"{bm.blocks_needed(head)} KV blocks and {head.encoder_len + sum(len(s) for s in head.seqs)} "
            f"tokens; {bm.num_free_blocks()} of {bm.num_total_blocks()} blocks are free "
            f"(watermark {bm.watermark_blocks}), max_num_batched_tokens="
            f"{self.scheduler_config.max_num_batched_tokens}; {len(sch.waiting)} requests wait"
        )

    def _check_stop(self, seq: Sequence, group: SequenceGroup) -> None:
        """Stops on token ids and length; stop strings are the output processor's."""
        p = group.sampling_params
        token = seq.output_token_ids[-1]
        num_out = len(seq.output_token_ids)
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token in p.stop_token_ids:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return
        if num_out >= p.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH

    # -- swapping --------------------------------------------------------------
    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each ``dst`` device block gets ``src``'s K/V in every layer."""
        device = self.kv_caches[0].device
        src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for cache in self.kv_caches:  # [2, num_blocks, block_size, heads, head_size]
            cache.index_copy_(1, dst_ids, cache.index_select(1, src_ids))

    def _swap(self, mapping: list[tuple[int, int]], to_cpu: bool) -> None:
        if self._swap_caches is None:
            n = self.block_manager.num_total_blocks(Device.CPU)
            # empty, not zeros: the OS commits a page when a swapped block first
            # lands on it, so swap_space costs memory only as it is used. Only
            # blocks that were swapped out are ever read back.
            self._swap_caches = [
                torch.empty(self._cache_shape(n), dtype=self.config.torch_dtype, device="cpu")
                for _ in range(self._num_layers)
            ]
        src_ids = torch.tensor([s for s, _ in mapping], dtype=torch.long)
        dst_ids = torch.tensor([d for _, d in mapping], dtype=torch.long)
        for dev_cache, cpu_cache in zip(self.kv_caches, self._swap_caches):
            src, dst = (dev_cache, cpu_cache) if to_cpu else (cpu_cache, dev_cache)
            moved = src.index_select(1, src_ids.to(src.device)).to(dst.device)
            dst.index_copy_(1, dst_ids.to(dst.device), moved)
        if to_cpu:
            self.stats.swapped_out_blocks += len(mapping)
        else:
            self.stats.swapped_in_blocks += len(mapping)
