"""``TandemTranscriber``: speech-to-text over a Ray Data dataset (Whisper, or a
plugin's model that supports transcription), one engine per actor.

>>> ds = ray.data.read_binary_files("s3://bucket/calls/")          # column "bytes"
>>> out = ds.map_batches(
...     TandemTranscriber,
...     fn_constructor_kwargs={"model": "openai/whisper-small", "audio_column": "bytes",
...                            "transcribe_options": {"language": "en", "timestamps": True}},
...     compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1, batch_size=16,
... )

Each row's audio is what ``LLM.transcribe`` takes: an encoded file's bytes (any
format the ``audio`` extra decodes), a file path, samples (a float array, with
``sampling_rate`` or a ``sampling_rate_column``), or ``{"audio": ..., "sampling_rate": ...}``;
any length (long audio is decoded window by window). The output keeps the input
columns and adds the text, the language and, with ``timestamps``, the segments;
a row that cannot be served has its reason in ``error`` and the job goes on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.integrations.ray.batches import column, columns, plain, with_columns
from tandem.integrations.ray.lora_column import LoRAColumn


class TandemTranscriber:
    """A Ray Data callable class: ``ds.map_batches(TandemTranscriber, fn_constructor_kwargs=...)``.

    ``model`` and ``**engine_args``: as :class:`tandem.LLM`. ``transcribe_options``: the
    keywords of :meth:`tandem.LLM.transcribe` (``language``, ``task``, ``timestamps``,
    ``temperature``, ...), the same for every row. ``lora_column`` / ``lora_modules``:
    each row's LoRA adapter, as :class:`~tandem.integrations.ray.data.TandemPredictor`'s."""

    def __init__(
        self,
        model: str,
        *,
        transcribe_options: dict[str, Any] | None = None,
        audio_column: str = "audio",
        sampling_rate: int | None = None,
        sampling_rate_column: str | None = None,
        text_column: str = "text",
        language_column: str = "language",
        segments_column: str = "segments",
        error_column: str = "error",
        lora_column: str | None = None,
        lora_modules: dict[str, str] | None = None,
        **engine_args: Any,
    ) -> None:
        from tandem.entrypoints.llm import LLM

        self.lora = LoRAColumn(lora_column, lora_modules, engine_args)
        options = dict(transcribe_options or {})
        for reserved in ("audio", "sampling_rate", "use_tqdm", "lora_request"):
            if reserved in options:
                raise ValueError(f"transcribe_options[{reserved!r}]: set by the transcriber (audio_column, "
                                 "sampling_rate / sampling_rate_column), not an option")
        self.options = options
        self.audio_column = audio_column
        self.sampling_rate, self.sampling_rate_column = sampling_rate, sampling_rate_column
        self.names = {"text": text_column, "language": language_column, "error": error_column}
        if options.get("timestamps") or options.get("word_timestamps"):
            self.names["segments"] = segments_column
        self.llm = LLM(model, **engine_args)

    def __call__(self, batch: Any) -> Any:
        cols, was_pandas = columns(batch)
        audio = column(cols, self.audio_column, "audio_column")
        rates = (column(cols, self.sampling_rate_column, "sampling_rate_column")
                 if self.sampling_rate_column is not None else None)
        loras = self.lora.values(cols)
        inputs, rows, row_loras = [], [], []
        results: list[dict[str, Any]] = [{} for _ in range(len(audio))]
        for i in range(len(audio)):
            try:
                item = _audio(audio[i], self.sampling_rate if rates is None else plain(rates[i]))
                row_loras.append(self.lora.request(loras, i))
                inputs.append(item)
                rows.append(i)
            except (TypeError, ValueError) as e:
                results[i] = {"error": f"row {i}: {e}"}
        if inputs:
            # One call for the batch: its windows are decoded together. A row whose audio
            # cannot be read or served comes back with its error.
            outs = self.llm.transcribe(inputs, use_tqdm=False, lora_request=row_loras, **self.options)
            for i, t in zip(rows, outs):
                results[i] = ({"error": t.error} if t.error is not None else
                              {"text": t.text, "language": t.language, "segments": t.segments})
        new = {name: [r.get(key) for r in results] for key, name in self.names.items()}
        return with_columns(batch, was_pandas, new)


def _audio(value: Any, sampling_rate: Any) -> Any:
    value = plain(value)
    if isinstance(value, dict):
        value.setdefault("sampling_rate", sampling_rate)
        if value.get("sampling_rate") is None:
            value.pop("sampling_rate")
        return value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, np.ndarray) or isinstance(value, list):
        if sampling_rate is None:
            raise ValueError("audio samples need their sampling rate: give sampling_rate= or sampling_rate_column=")
        return {"audio": np.asarray(value, dtype=np.float32), "sampling_rate": int(sampling_rate)}
    raise TypeError(f"audio must be file bytes, a path, samples or {{'audio': ..., 'sampling_rate': ...}}, got "
                    f"{type(value).__name__}: {value!r:.200}")
