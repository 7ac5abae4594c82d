"""`tandem serve` start-up says what it is doing: the engine load takes seconds to minutes."""

from __future__ import annotations

import logging
import types

from tandem.demo_whisper import PATH as DEMO
from tandem.entrypoints import cli
from tandem.entrypoints.openai import api_server


def test_serve_says_what_it_is_starting_and_when_it_listens(monkeypatch, caplog):
    """`tandem serve` start-up (the engine load takes seconds to minutes) says at INFO what it
    starts and, once it is up, how long that took and where it listens (engine, app and server
    stubbed: the lines are what is measured)."""
    made = []
    monkeypatch.setattr(api_server, "AsyncLLM", lambda model, **kwargs: made.append(model) or object())
    monkeypatch.setattr(api_server, "build_app", lambda engine, **kwargs: types.SimpleNamespace(
        state=types.SimpleNamespace(drain_cut=None)))
    monkeypatch.setattr(api_server, "make_server", lambda config, **kwargs: types.SimpleNamespace(run=lambda: None))
    args = cli._build_parser()[0].parse_args(["serve", str(DEMO), "--port", "8123", "--served-model-name", "demo"])
    with caplog.at_level(logging.INFO, logger="tandem.serve"):
        assert api_server.serve(args) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.serve"]
    assert made == [str(DEMO)]
    assert lines[0] == f"tandem serve: starting the engine for {DEMO} (then listening on http://{args.host}:8123)"
    assert lines[1].startswith("tandem serve: engine started in ") and \
        lines[1].endswith(f" s; serving 'demo' on http://{args.host}:8123")
