"""mBART / mBART-50, M2M100 / NLLB and Pegasus: BART's layers with other ``BartVariant`` flags.

| model | layers | positions | embedding LN | final LN | logits bias |
|---|---|---|---|---|---|
| mBART | pre-LN | learned, offset 2 | yes | yes | ``final_logits_bias`` |
| M2M100 / NLLB | pre-LN | fairseq sin/cos from ``pad_token_id + 1`` | no | yes | none |
| Pegasus | pre-LN | Marian's sin/cos table, offset 0 | no | yes | ``final_logits_bias`` |

``scale_embedding``, ``activation_function`` and ``tie_word_embeddings`` come from the
config, as in BART. All three start decoding from ``decoder_start_token_id`` alone,
as HF ``generate`` does; the target language of mBART-50 / M2M100 / NLLB is the token
``forced_bos_token_id`` forces next (``docs/models.md``).
"""

from __future__ import annotations

from tandem.model_zoo.bart import BartForConditionalGeneration, BartVariant


class _PreLNFamily(BartForConditionalGeneration):
    """What the three share beyond the variant: how decoding starts."""

    @classmethod
    def get_default_decoder_prompt(cls, config) -> list[int]:
        # HF generate starts from decoder_start_token_id alone; a language token (mBART-50,
        # NLLB) comes from forced_bos_token_id, not from the config's bos_token_id.
        return [cls.decoder_start_token_id(config)]

    @classmethod
    def decoder_start_token_id(cls, config) -> int:
        # HF generate falls back to bos_token_id when the config names no decoder start
        # (mbart-large-cc25's config has none).
        for field in ("decoder_start_token_id", "bos_token_id"):
            value = getattr(config, field, None)
            if value is not None:
                return int(value)
        raise ValueError(f"{cls.__name__}: config.json has neither decoder_start_token_id nor bos_token_id")


class MBartForConditionalGeneration(_PreLNFamily):
    variant = BartVariant(normalize_before=True, layernorm_embedding=True, final_layer_norm=True, position_offset=2)


class PegasusForConditionalGeneration(_PreLNFamily):
    variant = BartVariant(
        normalize_before=True, layernorm_embedding=False, final_layer_norm=True, position_offset=0,
        sinusoidal_positions=True,
    )


class M2M100ForConditionalGeneration(_PreLNFamily):
    """Also NLLB-200 (its checkpoints name this class). No ``final_logits_bias``: the buffer
    stays zero and the LM head skips it."""

    variant = BartVariant(normalize_before=True, layernorm_embedding=False, final_layer_norm=True, fairseq_positions=True)

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < config.vocab_size:
            raise ValueError(
                f"config.json: pad_token_id={pad!r} must be a token id in [0, {config.vocab_size}): "
                "M2M100's positions are numbered from it"
            )
        if config.d_model < 4:
            raise ValueError(
                f"config.json: d_model={config.d_model} is too small for M2M100's sinusoidal positions "
                "(which divide by d_model // 2 - 1): it must be at least 4"
            )

    def hf_to_tandem_name(self, name: str) -> str | None:
        if name.endswith("embed_positions.weights"):
            return None  # HF's computed table, when a save carries it; ours is the same, computed
        return super().hf_to_tandem_name(name)
