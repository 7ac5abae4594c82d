"""The ``tandem`` command: ``generate``, ``plugins``, ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_WHISPER = Path(__file__).resolve().parent.parent / "demo_whisper"

# What a command can fail with that is the user's to fix: printed as one line, exit 2.
# (Some prompts or files failing while the others ran is exit 1; interrupted, 130.)
_USER_ERRORS = (ValueError, TypeError, RuntimeError, ImportError, OSError)
# The sampling settings llm.transcribe takes (its windows' decoding sets the rest).
_TRANSCRIBE_SAMPLING = ("temperature", "num_beams")


def _version() -> str:
    try:
        return version("tandem-engine")
    except PackageNotFoundError:
        return "0.0.0+unknown"


class _Parser(argparse.ArgumentParser):
    """A usage error is one line naming the bad value and where to look, exit 2:
    not argparse's usage block, which buries the error under every flag."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it is None/False or its help already says it
    (an option defaulting to None says in its help what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "(default:" in text:
            return text
        return super()._get_help_string(action)


def _add_engine_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from tandem.core.engine_args import add_cli_args

    return add_cli_args(p)


def _add_sampling_flags(p: argparse.ArgumentParser, **kwargs) -> argparse.ArgumentParser:
    from tandem.entrypoints.sampling_options import add_sampling_args

    return add_sampling_args(p, **kwargs)


def _sampling_kwargs(args) -> dict:
    from tandem.entrypoints.sampling_options import sampling_kwargs

    return sampling_kwargs(args)


def _build_parser(engine_flags: bool = True) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    # The engine flags come from EngineConfig, whose module imports torch (seconds): a
    # command line that names no command (`tandem --help`, `--version`) is parsed without them.
    add_cli_args = _add_engine_flags if engine_flags else (lambda p: p)
    add_sampling_args = _add_sampling_flags if engine_flags else (lambda p, **kwargs: p)
    parser = _Parser(prog="tandem", description="Encoder/decoder inference engine")
    parser.add_argument("--version", action="version", version=f"tandem-engine {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,transcribe,serve,plugins,demo}")
    fmt = _HelpFormatter

    gen = sub.add_parser("generate", help="generate for each prompt and print the outputs", formatter_class=fmt)
    gen.add_argument("--model", required=True, help="local checkpoint directory or Hugging Face Hub repo id (org/name)")
    add_cli_args(gen)
    add_sampling_args(gen)  # every SamplingParams field marked cli=
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    gen.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                     help="engine replicas the prompts are dealt out to, each in a process of its own with its share "
                          "of the threads (LLM's data_parallel_size; docs/distributed.md)")
    gen.add_argument("prompts", nargs="+", help="encoder prompts; '-' reads one per line from stdin")

    tr = sub.add_parser("transcribe", help="transcribe audio files with a Whisper checkpoint (or another speech "
                        "model that supports transcription)", formatter_class=fmt)
    tr.add_argument("model", help="local checkpoint directory or Hugging Face Hub repo id (Whisper, or a plugin's "
                    "speech model)")
    tr.add_argument("files", nargs="+", help="audio files (WAV, FLAC, OGG, MP3; other containers with PyAV)")
    add_cli_args(tr)
    tr.add_argument("--language", default=None, help="language code or name (default: detected per file)")
    tr.add_argument("--task", default="transcribe", choices=["transcribe", "translate"],
                    help="transcribe: text in the spoken language; translate: English text")
    tr.add_argument("--format", default="text", choices=["text", "json", "srt", "vtt"],
                    help="text: 'FILE<TAB>transcript' per line; json: one object per line (with segments when "
                         "timestamped); srt / vtt: subtitles (timestamps on)")
    tr.add_argument("--timestamps", action="store_true", help="decode timestamps (segments in json)")
    tr.add_argument("--word-timestamps", action="store_true",
                    help="each word's start and end (json: 'words'; needs the checkpoint's alignment_heads)")
    tr.add_argument("--output-dir", default=None,
                    help="write one FILE_STEM.<format> per input here (needed for srt/vtt with several files) "
                         "(default: none, print to stdout)")
    add_sampling_args(tr, only=_TRANSCRIBE_SAMPLING)
    tr.add_argument("--no-speech-threshold", type=float, default=None,
                    help="skip a window as silence when its <|nospeech|> probability is above this and its average "
                         "log-probability below --logprob-threshold (or above this alone, without one) (default: "
                         "none, no window skipped)")
    tr.add_argument("--logprob-threshold", type=float, default=None,
                    help="the average log-probability below which a window counts as unsure: with "
                         "--no-speech-threshold, skipped when also likely silence (default: none)")
    tr.add_argument("--initial-prompt", default=None, metavar="TEXT",
                    help="text the first window of each file is prompted with (faster-whisper's initial_prompt) "
                         "(default: none)")
    tr.add_argument("--vad-filter", action="store_true",
                    help="find the speech with Silero VAD and decode its chunks (at most 30 s each, silence "
                         "dropped) in parallel, faster-whisper's batched pipeline (needs the vad extra)")
    tr.add_argument("--vad-parameters", type=_json_object, default=None, metavar="JSON",
                    help="with --vad-filter: faster-whisper's VadOptions as a JSON object, e.g. "
                         "'{\"threshold\": 0.6, \"min_silence_duration_ms\": 500}' (default: faster-whisper's "
                         "batched defaults)")
    tr.add_argument("--vad-method", default=None, choices=["silero", "energy"],
                    help="with --vad-filter: silero (Silero VAD, the vad extra) or energy (loudness against the "
                         "input's quiet level, numpy only: for audio Silero does not hear as speech, such as the demo's "
                         "tone speech; takes the same --vad-parameters) (default: silero)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    sv = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API", formatter_class=fmt)
    sv.add_argument("model", help="local checkpoint directory or Hugging Face Hub repo id (org/name)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1/ routes (default: none, no key asked)")
    sv.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    sv.add_argument("--max-queued-requests", type=_positive_int, default=None,
                    help="sequences (prompts x n, or beams) that may wait for admission; a request that would go "
                         "over gets 503 with Retry-After (400 if it alone is over) (default: no limit)")
    sv.add_argument("--max-body-bytes", type=_positive_int, default=4 << 20,
                    help="request bodies (chunked or not, multipart included) are refused with 413 once over this")
    sv.add_argument("--max-audio-seconds", type=_non_negative_seconds, default=1800.0,
                    help="audio per request (uploads to the audio endpoints; a completion's inline or local "
                         "audio, all its prompts together): longer gets 413, checked from the file's header and "
                         "while decoding (0: no limit)")
    sv.add_argument("--allowed-local-media-path", type=_directory, default=None, metavar="DIR",
                    help="completion prompts may name audio files inside DIR (symlinks and '..' resolved first) "
                         "(default: none, a path in a prompt is refused: audio comes as inline bytes or uploads)")
    sv.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                    help="with --enable-lora: LoRA adapters served by name (a request's 'model' picks one), each "
                         "name=path or vLLM's JSON '{\"name\": ..., \"path\": ...}'; the path a PEFT adapter "
                         "directory or a Hub repo id (docs/lora.md) (default: none)")
    sv.add_argument("--lora-allowed-dir", type=_directory, default=None, metavar="DIR",
                    help="with --enable-lora: POST /v1/load_lora_adapter may load adapters from inside DIR "
                         "(symlinks and '..' resolved first) (default: none, runtime loading is off)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds running requests may take to finish after SIGTERM; then, or at once on a "
                         "second SIGTERM/SIGINT, they are answered with a JSON 503")
    # The defaults are tandem/entrypoints/openai/connections.py's (not imported here: it loads uvicorn).
    sv.add_argument("--header-timeout", type=_positive_seconds, default=10.0,
                    help="seconds a client has to send a whole request head, from connecting (or from its next "
                         "request's first byte), however it trickles in; then 408 and the connection is closed")
    sv.add_argument("--body-timeout", type=_positive_seconds, default=30.0,
                    help="seconds a request body may go without a byte before the connection is closed")
    sv.add_argument("--keep-alive-timeout", "--timeout-keep-alive", dest="keep_alive_timeout",
                    type=_positive_seconds, default=5.0,
                    help="seconds an idle connection is kept open after a response for the next request")
    add_cli_args(sv)

    plugins = sub.add_parser("plugins", help="list loaded plugins and what each registered", formatter_class=fmt)
    plugins.add_argument("--json", action="store_true", help="print a JSON list")

    demo = sub.add_parser("demo", help="run a shipped demo model: word reversal (text) or, with --whisper, tone speech",
                          formatter_class=fmt)
    add_cli_args(demo)
    demo.add_argument("--whisper", action="store_true",
                      help="the demo Whisper: transcribe its sample WAV files (needs the audio extra)")
    demo.add_argument("--path", action="store_true",
                      help="print the demo checkpoint's directory (with --whisper, the Whisper one) and exit: "
                           "give it to generate --model, transcribe or serve")
    demo.add_argument("--say", metavar="WORDS", default=None,
                      help="with --whisper: synthesize these words as tone speech and transcribe that "
                           "(20 words: zero..nine hello world yes no stop go up down left right) (default: none, the "
                           "shipped sample files)")
    demo.add_argument("--save", metavar="WAV", default=None, help="with --say: keep the synthesized audio in this file (default: none, not kept)")
    demo.add_argument("sentences", nargs="*", help="sentences to reverse (default: built-in examples)")
    return parser, {"generate": gen, "transcribe": tr, "serve": sv, "plugins": plugins, "demo": demo}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _directory(text: str) -> str:
    from tandem.entrypoints.openai.media import allowed_local_dir

    try:
        return allowed_local_dir(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a directory, got {text!r}") from None


def _lora_module(text: str) -> tuple[str, str]:
    from tandem.entrypoints.openai.lora_modules import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _llm(args, model: str, **extra):
    from tandem import LLM

    from tandem.core.engine_args import from_cli_args

    return LLM(model=model, **from_cli_args(args), **extra)


def _read_prompts(items: list[str]) -> list[str]:
    prompts = []
    for item in items:
        if item == "-":
            prompts.extend(line.rstrip("\n") for line in sys.stdin if line.strip())
        else:
            prompts.append(item)
    return prompts


def _params_per_prompt(args, llm, prompts: list[str]) -> list:
    """``--max-tokens`` (default: the generation config's) capped at what the model's decoder
    positions leave after each prompt's decoder prompt; a cap is reported once on stderr."""
    from tandem import SamplingParams

    capped = []
    params = []
    for prompt in prompts:
        try:
            room = llm.engine.max_new_tokens(prompt)
        except (ValueError, TypeError):
            room = None  # generate() reports this prompt's error
        want = args.max_tokens
        if room is not None and room >= 1 and want is not None and want > room:
            capped.append(room)
            want = room
        # Only what was given: the rest comes from the checkpoint's generation config.
        given = _sampling_kwargs(args)
        if want is not None:
            given["max_tokens"] = want
        params.append(SamplingParams(**given))
    if capped:
        positions = llm.engine.model_cls.max_decoder_len(llm.engine.hf_config)
        print(
            f"tandem generate: note: --max-tokens {args.max_tokens} capped to {max(capped)} or less for "
            f"{len(capped)} of {len(prompts)} prompts: the model has {positions} decoder positions, "
            "and the decoder prompt takes some",
            file=sys.stderr,
        )
    return params


def cmd_generate(args) -> int:
    prompts = _read_prompts(args.prompts)
    llm = _llm(args, args.model, data_parallel_size=args.data_parallel_size)
    outs = llm.generate(prompts, _params_per_prompt(args, llm, prompts), use_tqdm=False)
    failed = 0
    for prompt, out in zip(prompts, outs):
        if args.json:
            record = {"prompt": prompt, "error": out.error}
            if out.error is None:
                c = out.outputs[0]
                record.update(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
            print(json.dumps(record))
        elif out.error is not None:
            print(f"{prompt}\t[error] {out.error}")
        else:
            print(f"{prompt}\t{out.outputs[0].text}")
        failed += out.error is not None
    return 1 if failed else 0


def cmd_transcribe(args) -> int:
    from pathlib import Path

    from tandem.core.transcription import check_transcription
    from tandem.entrypoints.transcribe import subtitles

    model_cls, architecture = _model_class(args)
    check_transcription(model_cls, architecture)
    model_cls.check_audio_support()  # before the model loads
    if args.vad_parameters is not None and not args.vad_filter:
        raise ValueError("--vad-parameters without --vad-filter: give --vad-filter to use them")
    if args.vad_method is not None and not args.vad_filter:
        raise ValueError(f"--vad-method {args.vad_method} without --vad-filter: give --vad-filter to use it")
    vad_filter, vad_parameters = args.vad_filter, args.vad_parameters
    if args.vad_filter and args.vad_method == "energy":
        from tandem.entrypoints.vad_energy import EnergyVad

        vad_filter, vad_parameters = EnergyVad(args.vad_parameters), None  # a bad key or value fails here
    elif args.vad_filter:
        from tandem.entrypoints.vad import VadOptions, check_vad_support

        check_vad_support()
        VadOptions.from_dict(args.vad_parameters)  # a bad key or value fails before the model loads
    as_subtitles = args.format in ("srt", "vtt")
    if as_subtitles and len(args.files) > 1 and args.output_dir is None:
        raise ValueError(f"--format {args.format} with {len(args.files)} files: give --output-dir")
    llm = _llm(args, args.model)
    sampling = _sampling_kwargs(args)
    results = llm.transcribe(
        list(args.files), language=args.language, task=args.task, timestamps=args.timestamps or as_subtitles,
        word_timestamps=args.word_timestamps, use_tqdm=not args.no_progress, no_speech_threshold=args.no_speech_threshold,
        logprob_threshold=args.logprob_threshold, initial_prompt=args.initial_prompt, vad_filter=vad_filter,
        vad_parameters=vad_parameters, **sampling,
    )
    failed = 0
    for path, r in zip(args.files, results):
        failed += r.error is not None
        if r.error is not None:
            line = json.dumps({"file": path, "error": r.error}) if args.format == "json" else f"{path}\t[error] {r.error}"
            print(line, file=sys.stderr if as_subtitles else sys.stdout)
            continue
        if args.format == "json":
            record = {"file": path, "error": None, "text": r.text, "language": r.language, "token_ids": r.token_ids}
            if r.segments is not None:
                record["segments"] = r.segments
            if r.words is not None:
                record["words"] = r.words
            body = json.dumps(record)
        elif as_subtitles:
            body = subtitles(r.segments, args.format)
        else:
            body = f"{path}\t{r.text}"
        if args.output_dir is not None:
            out = Path(args.output_dir) / f"{Path(path).stem}.{args.format}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(body + "\n")
            print(out)
        else:
            print(body)
    return 1 if failed else 0


def _model_class(args):
    """The model class and architecture that serve ``args.model``, from its config.json
    alone (nothing loaded): what the engine will resolve."""
    from tandem.core.loader import load_hf_config
    from tandem.plugins import default_model_registry

    from tandem.core.checkpoint_source import resolve_checkpoint

    registry = default_model_registry()  # first: plugins may teach AutoConfig the checkpoint's model_type
    # The same directory LLM will read (a Hub id's snapshot; fetched once, then the engine finds it cached).
    model_dir = resolve_checkpoint(args.model, "model", revision=args.revision, download_dir=args.download_dir)
    config = load_hf_config(model_dir, trust_remote_code=getattr(args, "trust_remote_code", False))
    return registry.resolve(getattr(config, "architectures", None))


def cmd_serve(args) -> int:
    try:
        from tandem.entrypoints.openai.api_server import serve
    except ImportError as e:
        raise ImportError(f"tandem serve needs the serve extra: pip install 'tandem-engine[serve]' ({e})") from e

    return serve(args)


def cmd_plugins(args) -> int:
    # Lists the healthy plugins even when one is broken, marking it; exit 1 then, so scripts notice.
    from tandem.plugins.defaults import auto_target
    from tandem.plugins.manager import exclusion_hint
    from tandem.plugins import plugin_report

    plugins = plugin_report()
    broken = [p.name for p in plugins if p.error is not None]
    if args.json:
        print(json.dumps([vars(p) for p in plugins], indent=2))
    else:
        device, dtype, why = auto_target()
        print(f"here: {device.type}/{str(dtype).removeprefix('torch.')}, what --device auto and --dtype auto "
              f"resolve to on this machine ({why})\n")
    for info in [] if args.json else plugins:
        status = f"  BROKEN: {info.error}" if info.error is not None else ""
        print(f"{info.name}  ({info.value}, from {info.distribution or 'unknown distribution'}){status}")
        if info.models:
            print(f"    models:   {', '.join(info.models)}")
        if info.backends:
            print(f"    backends: {', '.join(info.backends)}")
        for name, lines in info.backend_capabilities.items():
            print(f"      {name}:")
            for key, text in lines.items():
                print(f"        {key + ':':13} {text}")
    if not plugins and not args.json:
        print("no plugins loaded")
    if broken:
        print(f"tandem plugins: broken: {', '.join(broken)}; {exclusion_hint(plugins)}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args) -> int:
    if args.path:
        print(DEMO_WHISPER if args.whisper else DEMO_MODEL)
        return 0
    if args.whisper:
        return _demo_whisper(args)
    if args.say is not None or args.save is not None:
        raise ValueError("--say and --save are for the Whisper demo: tandem demo --whisper --say 'three one four'")
    return _demo_text(args)


def _demo_text(args) -> int:
    from tandem import SamplingParams

    examples = json.loads((DEMO_MODEL / "demo_sentences.json").read_text())
    if args.sentences:
        examples = [{"input": s, "expected": " ".join(reversed(s.split()))} for s in args.sentences]
    specials = {"<s>", "<pad>", "</s>", "<unk>"}
    vocab = set(json.loads((DEMO_MODEL / "tokenizer.json").read_text())["model"]["vocab"]) - specials
    unknown = [[w for w in e["input"].split() if w not in vocab] for e in examples]
    runnable = [e for e, bad in zip(examples, unknown) if not bad]
    outs = iter([])
    if runnable:
        llm = _llm(args, str(DEMO_MODEL))
        outs = iter(llm.generate([e["input"] for e in runnable], SamplingParams(temperature=0.0, max_tokens=16),
                                 use_tqdm=False))
    print("tandem demo: a tiny BART trained to reverse the words of a sentence\n")
    right = 0
    for e, bad in zip(examples, unknown):
        if bad:
            words = ", ".join(repr(w) for w in bad)
            print(f"  input:  {e['input']}\n  not run: {words} {'is' if len(bad) == 1 else 'are'} not in the demo "
                  f"model's vocabulary ({len(vocab)} lowercase words; see {DEMO_MODEL / 'TRAINING.md'})\n")
            continue
        out = next(outs)
        got = out.error if out.error is not None else out.outputs[0].text
        ok = out.error is None and got == e["expected"]
        right += ok
        print(f"  input:  {e['input']}\n  output: {got}\n  {'right' if ok else 'WRONG, expected: ' + e['expected']}\n")
    skipped = len(examples) - len(runnable)
    print(f"{right}/{len(runnable)} right" + (f"; {skipped} not run (words outside the vocabulary)" if skipped else ""))
    if not runnable:
        return 2
    return 0 if right == len(examples) else 1


def _demo_whisper(args) -> int:
    import tempfile

    from tandem.demo_whisper import WORDS, synthesize, unknown_words, write_wav

    if args.sentences:
        raise ValueError(
            "tandem demo --whisper takes words with --say; to transcribe a file: "
            'tandem transcribe "$(tandem demo --whisper --path)" FILE.wav'
        )
    try:
        import soundfile  # noqa: F401
    except (ImportError, OSError) as e:
        raise ImportError(f"tandem demo --whisper reads WAV files: pip install 'tandem-engine[audio]' ({e})") from e
    with tempfile.TemporaryDirectory() as tmp:
        if args.say is not None:
            bad = unknown_words(args.say)
            if bad or not args.say.split():
                raise ValueError(
                    f"--say {args.say!r}: " + (", ".join(repr(w) for w in bad) + " not in" if bad else "no words from")
                    + f" the demo Whisper's vocabulary ({len(WORDS)} words: {' '.join(WORDS)})"
                )
            wav = write_wav(args.save or Path(tmp) / "say.wav", synthesize(args.say))
            examples = [{"file": str(wav), "expected": " ".join(args.say.split())}]
        else:
            examples = [{**e, "file": str(DEMO_WHISPER / e["file"])}
                        for e in json.loads((DEMO_WHISPER / "demo_samples.json").read_text())]
        llm = _llm(args, str(DEMO_WHISPER))
        results = llm.transcribe([e["file"] for e in examples], use_tqdm=False, temperature=0.0)
    print(f"tandem demo --whisper: a tiny Whisper trained to transcribe tone speech ({len(WORDS)} words, each a pair "
          f"of tones; see {DEMO_WHISPER / 'TRAINING.md'})\n")
    right = 0
    for e, r in zip(examples, results):
        got = f"[error] {r.error}" if r.error is not None else r.text
        ok = r.error is None and r.text == e["expected"]
        right += ok
        kept = "" if args.say is not None and args.save is None else f"  audio:    {e['file']}\n"
        print(f"{kept}  expected: {e['expected']}\n  output:   {got}\n  {'right' if ok else 'WRONG'}\n")
    print(f"{right}/{len(examples)} right")
    print('transcribe a file yourself: tandem transcribe "$(tandem demo --whisper --path)" FILE.wav')
    return 0 if right == len(examples) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"] and "--path" in argv:
        # Prints a directory: parsed without the engine flags, whose module imports torch
        # (seconds), unless the line names one of them.
        args, extra = _build_parser(engine_flags=False)[0].parse_known_args(argv)
        if not extra:
            return cmd_demo(args)
    # The top level takes no option with a value, so a word that is not an option names a command.
    parser, subparsers = _build_parser(engine_flags=any(not a.startswith("-") for a in argv))
    args, extra = parser.parse_known_args(argv)
    if extra:  # a bad flag: named by the subcommand it was given to
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    handlers = {"generate": cmd_generate, "transcribe": cmd_transcribe, "serve": cmd_serve, "plugins": cmd_plugins,
                "demo": cmd_demo}
    try:
        from tandem.logger import configure_cli_logging

        configure_cli_logging()
        return handlers[args.command](args)
    except _USER_ERRORS as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
