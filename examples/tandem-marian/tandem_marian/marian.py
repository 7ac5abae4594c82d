"""Marian / OPUS-MT (HF ``MarianMTModel``) on top of tandem's BART implementation.

Marian is a post-LN BART with these differences, all of them here or in the variant:

- sinusoidal position embeddings, from position 0 (no offset), computed rather
  than learned, with HF's float32 numerics;
- no layernorm after the embeddings, no final layernorm;
- ``scale_embedding=True`` and ``activation_function="swish"`` in OPUS-MT
  configs (read from the config, as BART does);
- one embedding matrix shared by encoder, decoder and LM head;
- decoding starts from ``decoder_start_token_id`` (the pad token) alone;
- the pad token is never generated.

Layers, weight names and loading are BART's (``tandem.core.layers`` and the
generic loader): OPUS-MT checkpoints use the same names, so this file holds no
loading logic.
"""

from __future__ import annotations

from tandem.model_zoo.bart import BartForConditionalGeneration, BartVariant


class MarianForConditionalGeneration(BartForConditionalGeneration):
    variant = BartVariant(layernorm_embedding=False, position_offset=0, sinusoidal_positions=True)

    def __init__(self, config, ctx) -> None:
        if not getattr(config, "share_encoder_decoder_embeddings", True):
            raise ValueError(
                "MarianMTModel: share_encoder_decoder_embeddings=False (separate source and target "
                "vocabularies) is not supported by tandem-marian"
            )
        super().__init__(config, ctx)

    @classmethod
    def get_default_decoder_prompt(cls, config) -> list[int]:
        # HF generate starts encoder/decoder models from decoder_start_token_id only; Marian
        # has no BOS of its own (OPUS-MT configs set bos_token_id to EOS's id, 0), so the
        # base class's <DEC><BOS> would feed </s> as the second decoder token.
        return [cls.decoder_start_token_id(config)]
