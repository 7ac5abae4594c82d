"""``TandemPredictor``: generation over a Ray Data dataset, one engine per actor.

>>> import ray
>>> from tandem.integrations.ray.data import TandemPredictor
>>> ds = ray.data.from_items([{"prompt": "the rain in spain"}, ...])
>>> out = ds.map_batches(
...     TandemPredictor,
...     fn_constructor_kwargs={"model": "facebook/bart-large-cnn",
...                            "sampling_params": {"temperature": 0.0, "max_tokens": 64}},
...     concurrency=4,       # actors, each with its own engine
...     num_gpus=1,          # per actor, on GPU nodes
...     batch_size=64,
... )

Each row's prompt (column ``prompt_column``) is any prompt ``LLM.generate`` takes:
a string, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``, an
encoder/decoder pair ``{"encoder_prompt": ..., "decoder_prompt": ...}`` or, for
audio models, ``{"audio": samples, "sampling_rate": hz}``. The output keeps the
input columns and adds the first (best) completion's text and token ids, its
finish reason, and ``error``: a row that cannot be served has its reason there
(and ``None`` in the others) while the rest of the batch and the job go on.

LoRA adapters per row: ``lora_column`` names a column whose value is the row's
adapter (``lora_column.py``; with ``enable_lora=True``), a name of
``lora_modules={name: path}`` or a path; empty: the base model.
"""

from __future__ import annotations

from typing import Any

from tandem.core.sampling_params import SamplingParams
from tandem.integrations.ray.batches import column, columns, plain, with_columns
from tandem.integrations.ray.lora_column import LoRAColumn


class TandemPredictor:
    """A Ray Data callable class: ``ds.map_batches(TandemPredictor, fn_constructor_kwargs=...)``.

    ``model`` and ``**engine_args``: as :class:`tandem.LLM` (``help(LLM)``).
    ``sampling_params``: a :class:`SamplingParams` or a dict of its fields, for every
    row (default: the checkpoint's generation config). ``sampling_params_column``: a
    column of such dicts, one per row, over the shared ones (a bad one is that row's
    error). The ``*_column`` names say where the prompt is read and where the outputs
    are written. ``lora_column``: each row's LoRA adapter (a name of ``lora_modules``,
    or a path; empty: the base model), ``enable_lora=True`` among the engine options."""

    def __init__(
        self,
        model: str,
        *,
        sampling_params: SamplingParams | dict | None = None,
        prompt_column: str = "prompt",
        sampling_params_column: str | None = None,
        text_column: str = "generated_text",
        token_ids_column: str = "generated_token_ids",
        finish_reason_column: str = "finish_reason",
        error_column: str = "error",
        lora_column: str | None = None,
        lora_modules: dict[str, str] | None = None,
        **engine_args: Any,
    ) -> None:
        from tandem.entrypoints.llm import LLM

        self.lora = LoRAColumn(lora_column, lora_modules, engine_args)
        self.params = _params(sampling_params)
        self.prompt_column, self.sampling_params_column = prompt_column, sampling_params_column
        self.out_names = (text_column, token_ids_column, finish_reason_column, error_column)
        self.llm = LLM(model, **engine_args)

    def __call__(self, batch: Any) -> Any:
        cols, was_pandas = columns(batch)
        prompts = column(cols, self.prompt_column, "prompt_column")
        per_row = (column(cols, self.sampling_params_column, "sampling_params_column")
                   if self.sampling_params_column is not None else None)
        loras = self.lora.values(cols)
        n = len(prompts)
        results: list[tuple] = [(None, None, None, None)] * n
        todo, todo_prompts, todo_params, todo_loras = [], [], [], []
        for i in range(n):
            try:
                prompt = _prompt(plain(prompts[i]))
                params = self.params if per_row is None else _row_params(self.params, plain(per_row[i]))
                lora = self.lora.request(loras, i)
            except (TypeError, ValueError) as e:
                results[i] = (None, None, None, f"row {i}: {e}")
                continue
            todo.append(i)
            todo_prompts.append(prompt)
            todo_params.append(params)
            todo_loras.append(lora)
        if todo:
            # One generate call for the batch: the engine batches the rows itself. A row
            # the engine rejects comes back with its error; EngineDeadError raises (the
            # actor is done for) and Ray's task retries decide what happens next.
            outs = self.llm.generate(todo_prompts, todo_params, use_tqdm=False, lora_request=todo_loras)
            for i, out in zip(todo, outs):
                results[i] = _row(out)
        new = {name: [r[k] for r in results] for k, name in enumerate(self.out_names)}
        return with_columns(batch, was_pandas, new)


def _params(value: SamplingParams | dict | None) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        return SamplingParams(**value)
    raise TypeError(f"sampling_params must be a SamplingParams or a dict of its fields, got "
                    f"{type(value).__name__}: {value!r}")


def _row_params(shared: SamplingParams, row: Any) -> SamplingParams:
    if row is None:
        return shared
    if not isinstance(row, dict):
        raise TypeError(f"sampling params must be a dict of SamplingParams fields, got {type(row).__name__}: {row!r}")
    return shared.replace(**row)


def _prompt(value: Any) -> Any:
    # Only the forms LLM.generate takes; a list of ints here would be read as a list of prompts.
    if isinstance(value, (str, dict)):
        return value
    raise TypeError(f"a prompt must be a str or a prompt dict ({{'prompt': ...}}, {{'prompt_token_ids': [...]}}, "
                    f"{{'encoder_prompt': ..., 'decoder_prompt': ...}}), got {type(value).__name__}: {value!r:.200}")


def _row(out) -> tuple:
    if out.error is not None:
        return None, None, None, out.error
    best = out.outputs[0]
    return best.text, list(best.token_ids), best.finish_reason, None
