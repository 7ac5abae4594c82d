"""``LLM``: offline batched generation."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from tandem.core.config import EngineConfig
from tandem.core.engine import LLMEngine
from tandem.core.inputs import PromptType
from tandem.core.outputs import RequestOutput
from tandem.core.sampling_params import SamplingParams


class LLM:
    """Generate with an encoder/decoder model from a local HF checkpoint directory.

    >>> llm = LLM(model="path/to/bart", dtype="float32")
    >>> llm.generate(["The rain in spain"], SamplingParams(temperature=0.0, max_tokens=32))
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "float32",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: float | None = None,
        swap_space: float = 1.0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        preemption_mode: str | None = None,
        attention_backend: str | None = None,
        seed: int = 0,
    ) -> None:
        config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            swap_space=swap_space,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
            attention_backend=attention_backend,
            seed=seed,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt that fails validation gets an output
        whose ``error`` says why; the other prompts are generated as usual."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, params):
            rid = str(next(self._ids))
            order.append(rid)
            try:
                engine.add_request(rid, prompt, p)
            except (ValueError, TypeError) as e:
                results[rid] = _rejected(rid, prompt, e)

        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, unit="req")
        bar.update(len(results))
        try:
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


def _rejected(rid: str, prompt, error: Exception) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    return RequestOutput(
        request_id=rid,
        encoder_prompt=text,
        encoder_prompt_token_ids=[],
        prompt=None,
        prompt_token_ids=[],
        outputs=[],
        finished=True,
        error=str(error),
    )
