"""Engine options are declared once (``EngineConfig``'s fields): the ``LLM`` / ``AsyncLLM``
keywords and every engine-building command's flags are exactly those fields, a bad value
fails the same way through each path, and unknown keywords are refused by name."""

import dataclasses
import inspect
import json
import math

import pytest

from tandem import LLM, AsyncLLM, SamplingParams
from tandem.core.config import EngineConfig
from tandem.core.engine_args import GROUP_TITLE, from_cli_args
from tandem.entrypoints import cli

# Every command that builds an engine; the test below fails when a command is added,
# so whoever adds one decides whether it takes the engine flags.
ENGINE_COMMANDS = {"generate", "transcribe", "serve", "demo"}
OTHER_COMMANDS = {"plugins"}
# The oracle: the dataclass's own fields, as dataclasses lists them (model is each entry
# point's own argument).
OPTIONS = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "model"}


def _subparsers():
    parser, subparsers = cli._build_parser()
    return subparsers


def _keyword_only(cls, skip=()):
    params = inspect.signature(cls).parameters
    assert list(params)[0] == "model"
    return {n: p for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in skip}


# LLM's own keyword beside the engine options: its replicas (docs/distributed.md).
@pytest.mark.parametrize("cls, skip", [(LLM, ("data_parallel_size",)), (AsyncLLM, ("start",))], ids=["LLM", "AsyncLLM"])
def test_the_keywords_are_exactly_the_engine_options_with_their_defaults(cls, skip):
    params = _keyword_only(cls, skip)
    assert list(params) == list(OPTIONS)
    for name, p in params.items():
        assert p.default == OPTIONS[name].default, name


def test_help_llm_lists_every_option_with_its_help():
    doc = inspect.getdoc(LLM.__init__)
    for f in OPTIONS.values():
        line = next(line for line in doc.splitlines() if line.startswith(f.name + ":") or line.startswith(f.name + " ("))
        assert f.metadata["help"].replace("`", "") in line, f.name


def test_every_engine_command_has_every_engine_flag_and_nothing_else_sets_them():
    subparsers = _subparsers()
    assert set(subparsers) == ENGINE_COMMANDS | OTHER_COMMANDS
    for command, p in subparsers.items():
        groups = [g for g in p._action_groups if g.title == GROUP_TITLE]
        engine = [a for g in groups for a in g._group_actions]
        others = [a for a in p._actions if a not in engine]
        assert not {a.dest for a in others} & set(OPTIONS), command  # e.g. no second --seed
        if command not in ENGINE_COMMANDS:
            assert not engine, command
            continue
        assert [a.dest for a in engine] == list(OPTIONS), command
        for a in engine:
            f = OPTIONS[a.dest]
            assert a.default == f.default, (command, a.dest)
            assert a.option_strings[0] == "--" + a.dest.replace("_", "-"), (command, a.option_strings)
            assert (a.choices and tuple(a.choices)) == (f.metadata["choices"] or None), (command, a.dest)
            help_text = p._get_formatter()._expand_help(a)
            assert f.metadata["help"].split("`")[0] in help_text, (command, a.dest)


def _non_default(f):
    """A value for the option other than its default, and its command-line spelling."""
    if f.metadata["choices"]:
        value = next(c for c in reversed(f.metadata["choices"]) if c != f.default)
        return value, [value]
    if isinstance(f.default, bool):  # --flag turns a False one on, --no-flag a True one off
        return not f.default, []
    kind = type(f.default) if f.default is not None else {"num_kv_blocks": int, "encoder_cache_blocks": int,
                                                               "prefix_cache_blocks": int, "max_cpu_loras": int,
                                                               "kv_cache_memory": float}.get(f.name, str)
    value = {int: 7, float: 2.5, str: "some/where"}[kind]
    return value, [str(value)]


def test_every_flag_round_trips_to_its_keyword():
    gen = _subparsers()["generate"]
    base = ["--model", "m", "hello"]
    assert from_cli_args(gen.parse_args(base)) == {n: f.default for n, f in OPTIONS.items()}
    assert from_cli_args(gen.parse_args(["--max-num-seqs", "4", *base]))["max_num_seqs"] == 4
    argv, want = [], {}
    for name, f in OPTIONS.items():
        value, words = _non_default(f)
        argv += [("--no-" if f.default is True else "--") + name.replace("_", "-"), *words]
        want[name] = value
    for command, p in _subparsers().items():
        if command in ENGINE_COMMANDS:
            positional = {"generate": base, "transcribe": ["m", "a.wav"], "serve": ["m"], "demo": []}[command]
            assert from_cli_args(p.parse_args(argv + positional)) == want, command
    # The old spelling of the backend flag still works.
    assert from_cli_args(gen.parse_args(["--backend", "torch_sdpa", *base]))["attention_backend"] == "torch_sdpa"


def test_generate_seed_is_the_engine_seed_and_request_seed_the_requests(bart_dir, monkeypatch, capsys):
    monkeypatch.setattr("tandem.logger.configure_cli_logging", lambda: None)
    common = dict(dtype="float32", device="cpu")

    def run(*flags):
        rc = cli.main(["generate", "--model", str(bart_dir), "--dtype", "float32", "--device", "cpu", "--json",
                       "--temperature", "1.0", "--max-tokens", "8", *flags, "the rain in spain"])
        out = capsys.readouterr().out
        assert rc == 0, out
        return json.loads(out)["token_ids"]

    def library(seed, request_seed=None):
        llm = LLM(model=str(bart_dir), seed=seed, **common)
        params = SamplingParams(seed=request_seed, temperature=1.0, max_tokens=8)
        return llm.generate("the rain in spain", params, use_tqdm=False)[0].outputs[0].token_ids

    engine0, engine5, request7 = library(0), library(5), library(0, request_seed=7)
    assert len({tuple(engine0), tuple(engine5), tuple(request7)}) == 3  # the seeds matter on this model
    assert run("--seed", "5") == engine5
    assert run("--request-seed", "7") == request7
    assert run("--seed", "5", "--request-seed", "7") == request7  # a request's own seed wins


@pytest.mark.parametrize("name, value, word, message", [
    ("max_num_seqs", 0, "0", "max_num_seqs=0: must be an integer >= 1"),
    ("block_size", 0, "0", "block_size=0: must be an integer in [1, 1024]"),
    ("swap_space", -1.0, "-1", "swap_space=-1.0: must be a finite number of GiB >= 0"),
    ("kv_cache_memory", math.nan, "nan", "kv_cache_memory=nan: must be a finite, positive number of GiB"),
    ("max_consecutive_step_failures", 0, "0", "max_consecutive_step_failures=0: must be an integer >= 1"),
])
def test_a_bad_value_fails_the_same_way_through_each_path(bart_dir, monkeypatch, capsys, name, value, word, message):
    monkeypatch.setattr("tandem.logger.configure_cli_logging", lambda: None)
    errors = []
    for build in (LLM, lambda model, **kw: AsyncLLM(model, start=False, **kw)):
        with pytest.raises(ValueError) as info:
            build(str(bart_dir), device="cpu", **{name: value})
        errors.append(str(info.value))
    rc = cli.main(["generate", "--model", str(bart_dir), "--device", "cpu", "--" + name.replace("_", "-"), word, "x"])
    assert rc == 2
    assert capsys.readouterr().err == f"tandem generate: error: {errors[0]}\n"
    assert errors == [message, message]


@pytest.mark.parametrize("owner", ["LLM", "AsyncLLM"])
def test_an_unknown_keyword_is_a_type_error_naming_it_and_the_options(bart_dir, owner):
    cls = {"LLM": LLM, "AsyncLLM": AsyncLLM}[owner]
    with pytest.raises(TypeError) as info:
        cls(str(bart_dir), max_num_seq=4)
    text = str(info.value)
    assert text.startswith(f"{owner}() got an unexpected keyword argument 'max_num_seq'; did you mean 'max_num_seqs'?")
    assert f"engine options: {', '.join(OPTIONS)}" in text
    with pytest.raises(TypeError, match=rf"^{owner}\(\) got an unexpected keyword argument 'frobnicate' \(engine"):
        cls(str(bart_dir), frobnicate=1)
    with pytest.raises(TypeError):  # options are keywords only
        cls(str(bart_dir), "float32")


def test_a_bad_choice_on_the_command_line_names_the_flag_and_the_value(capsys):
    with pytest.raises(SystemExit) as info:
        _subparsers()["serve"].parse_args(["m", "--preemption-mode", "drop"])
    assert info.value.code == 2
    assert "argument --preemption-mode: invalid choice: 'drop'" in capsys.readouterr().err


def test_help_text_refers_to_other_options_by_flag_on_the_command_line():
    p = _subparsers()["serve"]
    action = next(a for a in p._actions if a.dest == "num_kv_blocks")
    assert "overrides --kv-cache-memory" in p._get_formatter()._expand_help(action)
    assert "overrides kv_cache_memory" in inspect.getdoc(LLM.__init__)
