"""Loading the draft checkpoint of ``speculative_config={"model": DIR, ...}`` and
checking, before anything is allocated, that it can propose for the target.

The draft must be an encoder/decoder checkpoint tandem serves, reading the same
kind of encoder input (token ids, or audio features of as many mel bins),
with the same vocabulary (its size, the tokenizer's token -> id map when the
draft ships a tokenizer) and the same special ids (decoder start, BOS, EOS,
pad): its proposals are token ids the target verifies as its own. Every
mismatch is a ``ValueError`` naming the field and both values.
"""

from __future__ import annotations

import dataclasses
import logging

from tandem.core.kv.block_manager import BlockManager

from tandem.core.kv.block_pool import blocks_for
from tandem.core.config import EngineConfig
from tandem.core.loader import check_model_config, load_hf_config, load_tokenizer
from tandem.core.memory import check_fits
from tandem.core.model import EncoderDecoderModel
from tandem.core.speculative_config import SpeculativeConfig
from tandem.core.strategies.speculative.draft import DraftProposer

logger = logging.getLogger(__name__)

# Special ids both checkpoints must agree on (config.json's fields; decoder start
# through the model class, which knows each family's fallback).
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _takes_audio(cls: type[EncoderDecoderModel]) -> bool:
    return cls.get_audio_encoder_inputs.__func__ is not EncoderDecoderModel.get_audio_encoder_inputs.__func__


def check_compatible(spec: SpeculativeConfig, target_cls, target_hf, target_tokenizer, draft_cls, draft_hf,
                     draft_tokenizer) -> None:
    """``ValueError`` naming the first difference that would make the draft's proposals
    mean something else to the target."""
    where = f"speculative_config: model={spec.model!r}"

    def differ(what: str, target, draft) -> None:
        if target != draft:
            raise ValueError(f"{where}: the draft's {what} is {draft!r} but the target's is {target!r}; a draft "
                             "must share the target's vocabulary and special tokens")

    if _takes_audio(target_cls) != _takes_audio(draft_cls):
        kind = {True: "audio features", False: "token ids"}
        raise ValueError(f"{where}: the draft ({draft_cls.__name__}) reads {kind[_takes_audio(draft_cls)]} but "
                         f"the target ({target_cls.__name__}) reads {kind[_takes_audio(target_cls)]}")
    if _takes_audio(target_cls):
        differ("num_mel_bins", getattr(target_hf, "num_mel_bins", None), getattr(draft_hf, "num_mel_bins", None))
    differ("vocab_size", target_cls.vocab_size(target_hf), draft_cls.vocab_size(draft_hf))
    differ("decoder_start_token_id", target_cls.decoder_start_token_id(target_hf),
           draft_cls.decoder_start_token_id(draft_hf))
    for name in _SPECIAL_IDS:
        differ(name, getattr(target_hf, name, None), getattr(draft_hf, name, None))
    if target_tokenizer is not None and draft_tokenizer is not None:
        t, d = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t != d:
            diff = sorted(set(t.items()) ^ set(d.items()), key=lambda kv: kv[1])[:3]
            raise ValueError(f"{where}: the draft's tokenizer maps tokens to other ids than the target's "
                             f"({len(d)} vs {len(t)} tokens; first differences {diff}); a draft must share the "
                             "target's vocabulary")


def load_draft(config: EngineConfig, target_cls, target_hf, target_tokenizer, model_registry, backend_registry,
               target_num_blocks: int, eos_token_ids: list[int]) -> DraftProposer:
    """The draft model loaded on the target's device and dtype, with its own KV pool:
    as many blocks as the target's plus ``k`` tokens' worth per sequence (it mirrors
    the target's decoding sequences and their draft tokens)."""
    from tandem.core.attention import AttentionType
    from tandem.core.worker.worker import Worker

    spec = config.speculative
    where = f"speculative_config: model={spec.model!r}"
    try:
        dconfig = dataclasses.replace(
            config, model=spec.model, tokenizer=None, revision=None, tokenizer_revision=None,
            generation_config="none", speculative_config=None, dtype=config.torch_dtype, num_kv_blocks=None,
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    try:
        draft_hf = load_hf_config(dconfig.model_path, trust_remote_code=config.trust_remote_code)
        draft_cls, _ = model_registry.resolve(getattr(draft_hf, "architectures", None))
        check_model_config(draft_cls, draft_hf, dconfig.model_path, config.torch_dtype, config.torch_device,
                           generation_config="none")
        draft_tokenizer = load_tokenizer(dconfig.model_path, trust_remote_code=config.trust_remote_code)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    check_compatible(spec, target_cls, target_hf, target_tokenizer, draft_cls, draft_hf, draft_tokenizer)
    kv = draft_cls.kv_cache_spec(draft_hf)
    backend = backend_registry.select(
        config.attention_backend, device=config.torch_device, dtype=config.torch_dtype, head_size=kv.head_size,
        attn_types=frozenset(AttentionType), block_size=config.block_size, kv_cache_dtype=config.kv_cache_torch_dtype,
        attn_features=draft_cls.attn_features(draft_hf),
    ).backend
    worker = Worker(dconfig, draft_hf, draft_cls, backend, eos_token_ids)
    num_blocks = target_num_blocks + config.max_num_seqs * (blocks_for(spec.num_speculative_tokens, config.block_size) + 1)
    check_fits(f"the draft model's KV pool ({num_blocks} blocks)", num_blocks * worker.block_bytes,
               config.torch_device, "lower the target's pool (num_kv_blocks, kv_cache_memory) or max_num_seqs")
    worker.load_model()
    worker.initialize_cache(num_blocks, 0)
    bm = BlockManager(config.block_size, num_blocks, 0, encoder_cache_blocks=0)
    logger.info("draft model %s (%s) for speculation: k=%d, KV pool %d blocks, attention backend %s",
                draft_cls.__name__, spec.model, spec.num_speculative_tokens, num_blocks, backend.name)
    return DraftProposer(worker, bm, draft_cls.max_decoder_len(draft_hf), draft_cls.max_encoder_len(draft_hf))
