"""tandem's OpenAI server (``tandem serve``'s app) as a Ray Serve deployment, one
``AsyncLLM`` per replica; Serve's proxy spreads the requests over the replicas.

From the command line (``serve run`` passes each ``key=value`` to ``build_app``)::

    serve run tandem.integrations.ray.serve:build_app model=facebook/bart-large-cnn \\
        num_replicas=2 num_gpus=1 max_num_seqs=128 api_key=secret

From Python::

    from ray import serve
    from tandem.integrations.ray.serve import deployment
    serve.run(deployment("facebook/bart-large-cnn", num_replicas=2, dtype="float16"), route_prefix="/")

Every route, limit and error of ``tandem serve`` is the same (``tandem/entrypoints/openai``);
what ``tandem serve`` does with SIGTERM (drain, then cut) is Serve's here: a replica
being stopped gets ``graceful_shutdown_timeout_s`` for its requests, then its engine
shuts down (the app's lifespan). Keys: ``model``; the server's ``served_model_name``,
``api_key``, ``max_queued_requests``, ``max_body_bytes``, ``max_audio_seconds``,
``allowed_local_media_path`` (a directory on each replica's machine), ``lora_modules``
(with ``enable_lora``: ``lora_modules="a=/adapters/a b=/adapters/b"``, each as
``--lora-modules`` takes it) and ``lora_allowed_dir``; the
deployment's ``num_replicas``, ``num_cpus``, ``num_gpus`` (per replica); and every
engine option (``help(tandem.LLM)``), by its name or its flag's (``max-num-seqs``).
"""

from __future__ import annotations

import argparse
import difflib
import shlex
from typing import Any

from ray import serve

from tandem.core.engine_args import add_cli_args, from_cli_args, option_names

SERVER_KEYS = ("served_model_name", "api_key", "max_queued_requests", "max_body_bytes", "max_audio_seconds",
               "allowed_local_media_path", "lora_modules", "lora_allowed_dir")
DEPLOYMENT_KEYS = ("num_replicas", "num_cpus", "num_gpus")


@serve.deployment(name="tandem")
@serve.ingress()  # the app is built per replica, around that replica's engine
class TandemOpenAIServer:
    def __init__(self, model: str, engine_args: dict[str, Any], server_args: dict[str, Any]) -> None:
        from tandem.entrypoints.async_llm import AsyncLLM

        self._server_args = {"served_model_name": model, **server_args}
        self._engine = AsyncLLM(model, **engine_args)

    def __serve_build_asgi_app__(self):
        from tandem.entrypoints.openai.api_server import build_app as build_openai_app

        return build_openai_app(self._engine, **self._server_args)


def deployment(
    model: str,
    *,
    num_replicas: int = 1,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_body_bytes: int | None = None,
    max_audio_seconds: float | None = None,
    allowed_local_media_path: str | None = None,
    lora_modules: list[str] | list[tuple[str, str]] | None = None,
    lora_allowed_dir: str | None = None,
    **engine_args: Any,
) -> serve.Application:
    """The deployment, bound and ready for ``serve.run``: ``num_replicas`` replicas,
    each with ``num_cpus`` / ``num_gpus`` and its own engine built from ``model`` and
    ``engine_args`` (``help(tandem.LLM)``); the server options as ``tandem serve``'s flags
    (``lora_modules``: ``"name=path"`` strings or ``(name, path)`` pairs, as ``--lora-modules``)."""
    from tandem.core.engine_args import check_kwargs
    from tandem.entrypoints.openai.lora_modules import check_lora_flags, parse_lora_module

    check_kwargs("deployment", engine_args)
    if lora_modules is not None:
        lora_modules = [parse_lora_module(m) if isinstance(m, str) else tuple(m) for m in lora_modules]
    if lora_modules or lora_allowed_dir is not None:
        # Checked here, as ``tandem serve`` checks its flags, so a mistake costs no replica.
        check_lora_flags(served_model_name or model, model, engine_args, lora_modules or [], lora_allowed_dir)
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
    server = {"served_model_name": served_model_name, "api_key": api_key, "max_queued_requests": max_queued_requests,
              "max_body_bytes": max_body_bytes, "max_audio_seconds": max_audio_seconds,
              "allowed_local_media_path": allowed_local_media_path, "lora_modules": lora_modules,
              "lora_allowed_dir": lora_allowed_dir}
    server = {k: v for k, v in server.items() if v is not None}
    if server.get("max_audio_seconds") == 0:  # as the flag: 0 is no limit
        server["max_audio_seconds"] = None
    actor = {k: v for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)) if v is not None}
    options: dict[str, Any] = {"num_replicas": num_replicas}
    options.update(_rank_bundles(engine_args, actor))
    if actor:
        options["ray_actor_options"] = actor
    return TandemOpenAIServer.options(**options).bind(model, engine_args, server)


def _rank_bundles(engine_args: dict[str, Any], actor: dict[str, Any]) -> dict[str, Any]:
    """A tensor-parallel replica on Ray reserves its ranks with itself: a placement group of
    one bundle per rank (``{"GPU": 1}``, or ``{"CPU": 1}`` with ``device="cpu"``), which the
    Ray executor finds and fills, rank i in bundle i. The replica itself sits in bundle 0
    and reserves nothing of its own (it schedules; the ranks compute)."""
    tp = engine_args.get("tensor_parallel_size", 1)
    if engine_args.get("distributed_executor_backend") != "ray" or not isinstance(tp, int) or tp < 1:
        return {}
    if actor:
        raise ValueError(f"num_cpus / num_gpus ({actor}) with distributed_executor_backend='ray': the replica "
                         "reserves one bundle per tensor-parallel rank instead; leave them out")
    actor.update(num_cpus=0, num_gpus=0)
    bundle = {"CPU": 1.0} if str(engine_args.get("device", "auto")) == "cpu" else {"GPU": 1.0}
    return {"placement_group_bundles": [dict(bundle) for _ in range(tp)],
            "placement_group_strategy": engine_args.get("ray_placement_strategy", "STRICT_PACK")}


def build_app(args: dict[str, str]) -> serve.Application:
    """``serve run tandem.integrations.ray.serve:build_app model=... key=value ...``: each
    value parsed as the flag of the same name (``tandem serve --help``). An unknown key is
    a ``ValueError`` naming it, with close matches."""
    args = dict(args)
    model = args.pop("model", None)
    if not model:
        raise ValueError("build_app needs model=<checkpoint directory or Hub repo id>")
    parsed = _parser().parse_args(_argv(args))
    server = {k: getattr(parsed, k) for k in SERVER_KEYS}
    deploy = {k: getattr(parsed, k) for k in DEPLOYMENT_KEYS}
    return deployment(model, **deploy, **server, **from_cli_args(parsed))


class _ArgsError(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(f"build_app: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _ArgsError(prog="build_app", add_help=False)
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--num-cpus", type=float, default=None)
    p.add_argument("--num-gpus", type=float, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--max-body-bytes", type=int, default=None)
    p.add_argument("--max-audio-seconds", type=float, default=None)
    p.add_argument("--allowed-local-media-path", default=None)
    p.add_argument("--lora-modules", nargs="+", default=None)  # deployment() parses and checks them
    p.add_argument("--lora-allowed-dir", default=None)
    return add_cli_args(p)


def _argv(args: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": "8", "trust_remote_code": "true"}`` -> ``--max-num-seqs 8 --trust-remote-code``."""
    known = {k.replace("_", "-") for k in (*SERVER_KEYS, *DEPLOYMENT_KEYS, *option_names())}
    bools = {a.option_strings[0][2:] for a in _parser()._actions if isinstance(a, argparse._StoreTrueAction)}
    argv = []
    for key, value in args.items():
        name = str(key).replace("_", "-")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(c.replace('-', '_') for c in close)}?" if close else ""
            raise ValueError(f"build_app: unknown key {key!r}{hint} (keys: model, {', '.join(sorted(known))})")
        if name in bools:
            text = str(value).strip().lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"build_app: {key} is true or false, got {value!r}")
            if text in ("true", "1", "yes"):
                argv.append(f"--{name}")
            continue
        if name == "lora-modules":  # several: "a=/p b=/q" (shell quoting keeps a JSON module whole)
            argv += [f"--{name}", *shlex.split(str(value))]
            continue
        argv += [f"--{name}", str(value)]
    return argv
