"""Models by Hub repo id: a real huggingface_hub cache built in a temporary directory, read
offline (HF_HUB_OFFLINE) or with the Hub unreachable; nothing is mocked and nothing downloads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from helpers import hub_cache, make_bart
from tandem import LLM, SamplingParams
from tandem.core.checkpoint_source import allow_patterns, hub_error, resolve_checkpoint

REPO = "org/tiny-bart"
PROMPTS = ["the rain in spain", "red sun old king", "a cat sat on the mat"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# Nothing listens on the discard port: a Hub request fails at once, never reaching the network.
NOWHERE = "http://127.0.0.1:9"


@pytest.fixture
def offline(monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: the constant is what it consults.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", NOWHERE)


@pytest.fixture
def unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", NOWHERE)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="module")
def second_bart(tmp_path_factory):
    return make_bart(tmp_path_factory.mktemp("bart2") / "ckpt", seed=1)


def token_ids(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def llm(model, **kw):
    return LLM(model, dtype="float32", device="cpu", **kw)


def test_a_repo_id_generates_what_its_local_directory_does(bart_dir, tmp_path, offline):
    cache = tmp_path / "cache"
    snapshot = hub_cache(bart_dir, cache, REPO)
    by_id = llm(REPO, download_dir=str(cache))
    assert by_id.engine.config.model == REPO  # as given, for display
    assert by_id.engine.config.model_path == str(snapshot)
    assert by_id.get_tokenizer() is not None
    assert token_ids(by_id) == token_ids(llm(str(bart_dir)))


def test_a_revision_cached_by_ref_name_or_commit_is_served(bart_dir, second_bart, tmp_path, offline):
    cache = tmp_path / "cache"
    hub_cache(bart_dir, cache, REPO, refs=("main",))
    v2 = hub_cache(second_bart, cache, REPO, refs=("v2",))
    want_main, want_v2 = token_ids(llm(str(bart_dir))), token_ids(llm(str(second_bart)))
    assert want_main != want_v2  # the premise: the revisions tell apart
    assert token_ids(llm(REPO, download_dir=str(cache), revision="v2")) == want_v2
    assert token_ids(llm(REPO, download_dir=str(cache), revision=v2.name)) == want_v2
    assert token_ids(llm(REPO, download_dir=str(cache))) == want_main


def test_not_cached_while_offline_is_a_clear_error(bart_dir, tmp_path, offline):
    cache = tmp_path / "cache"
    hub_cache(bart_dir, cache, REPO)
    with pytest.raises(ValueError, match=r"model='org/absent': no such local directory, and not in the Hugging Face cache .*HF_HUB_OFFLINE is set"):
        llm("org/absent", download_dir=str(cache))
    with pytest.raises(ValueError, match=r"model='org/tiny-bart': no such local directory, and not in the Hugging Face cache .* at revision 'v9'"):
        llm(REPO, download_dir=str(cache), revision="v9")


def test_a_partly_cached_repo_names_what_is_missing(bart_dir, tmp_path, offline):
    cache = tmp_path / "cache"
    hub_cache(bart_dir, cache, REPO, files={"config.json", "tokenizer.json", "tokenizer_config.json"})
    with pytest.raises(ValueError, match=r"model='org/tiny-bart': the cached snapshot .* has no weights"):
        llm(REPO, download_dir=str(cache))


def test_a_snapshot_cached_by_another_tool_with_other_files_is_served(bart_dir, tmp_path, offline, caplog):
    # huggingface_hub >= 1.x keeps the repo's file list (trees/<commit>.json) beside a snapshot_download
    # and refuses a snapshot missing a file the allow-patterns take: here merges.txt, never fetched.
    cache = tmp_path / "cache"
    snapshot = hub_cache(bart_dir, cache, REPO)
    listing = {f.name: {"size": f.stat().st_size, "blob_id": "0" * 40} for f in snapshot.iterdir()}
    listing["merges.txt"] = {"size": 10, "blob_id": "1" * 40}
    trees = snapshot.parent.parent / "trees"
    trees.mkdir()
    (trees / f"{snapshot.name}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    with caplog.at_level("WARNING", logger="tandem.core.checkpoint_source"):
        got = token_ids(llm(REPO, download_dir=str(cache)))
    assert got == token_ids(llm(str(bart_dir)))
    import huggingface_hub

    if hasattr(huggingface_hub, "get_cached_repo_tree"):  # a version that checks the listing
        assert "serving the cached snapshot as it is" in caplog.text and "merges.txt" in caplog.text


def test_a_pytorch_bin_checkpoint_is_served_from_the_cache(bart_dir, tmp_path, offline):
    import torch
    from safetensors.torch import load_file

    src = tmp_path / "bin"
    shutil.copytree(bart_dir, src, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(bart_dir / "model.safetensors"), src / "pytorch_model.bin")
    hub_cache(src, tmp_path / "cache", REPO)
    assert token_ids(llm(REPO, download_dir=str(tmp_path / "cache"))) == token_ids(llm(str(bart_dir)))


def test_a_tokenizer_by_repo_id(bart_dir, tmp_path, offline):
    bare = tmp_path / "bare"
    shutil.copytree(bart_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    hub_cache(bart_dir, tmp_path / "cache", "org/tok")
    ref = llm(str(bart_dir)).generate(PROMPTS, GREEDY, use_tqdm=False)
    got = llm(str(bare), tokenizer="org/tok", download_dir=str(tmp_path / "cache")).generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]


def test_an_unreachable_hub_falls_back_to_the_cache(bart_dir, tmp_path, unreachable):
    cache = tmp_path / "cache"
    snapshot = hub_cache(bart_dir, cache, REPO)
    assert resolve_checkpoint(REPO, download_dir=str(cache)) == str(snapshot)
    with pytest.raises(ValueError, match=r"model='org/absent': the Hugging Face Hub cannot be reached .* not in the cache"):
        resolve_checkpoint("org/absent", download_dir=str(cache))


@pytest.mark.parametrize("name, why", [
    ("/no/such/dir", "no such directory"),
    ("./nowhere", "no such directory"),
    ("~/surely-no-such-dir-xyz", "no such directory"),
])
def test_local_looking_paths_are_never_looked_up(name, why, tmp_path, offline):
    with pytest.raises(ValueError, match=rf"model='{name}': not a local checkpoint directory \({why}\)"):
        resolve_checkpoint(name, download_dir=str(tmp_path))


def test_a_file_or_a_path_under_a_local_directory_is_a_local_path(bart_dir, tmp_path, monkeypatch, offline):
    monkeypatch.chdir(bart_dir.parent)
    with pytest.raises(ValueError, match=r"not a local checkpoint directory \(it is a file\)"):
        resolve_checkpoint(f"{bart_dir.name}/config.json")
    with pytest.raises(ValueError, match=r"not a local checkpoint directory \(no such directory under the local "
                                         rf"directory '{bart_dir.name}'\)"):
        resolve_checkpoint(f"{bart_dir.name}/missing")
    with pytest.raises(ValueError, match=r"nor a Hugging Face Hub repo id"):
        resolve_checkpoint("a/b/c/d")


def test_a_revision_for_a_local_directory_is_refused(bart_dir):
    with pytest.raises(ValueError, match=r"is a local directory: a revision \('v2'\) applies only to"):
        llm(str(bart_dir), revision="v2")
    with pytest.raises(ValueError, match=r"tokenizer_revision='v2' without a tokenizer"):
        llm(str(bart_dir), tokenizer_revision="v2")


@pytest.mark.parametrize("bad", ["../x", "main/../../x", "..", "./main", "/etc/passwd", "a//b", "main/",
                                 "..\\x", "C:x", "ma\nin"])
def test_a_revision_may_not_leave_refs(bad, bart_dir, second_bart, tmp_path, offline):
    """huggingface_hub reads ``refs/<revision>`` for the commit whose snapshot it serves; a
    revision that climbs out of refs/ reads a file of the attacker's choosing, whose content
    (an absolute path here) names the directory served: a checkpoint outside the cache."""
    cache = tmp_path / "cache"
    hub_cache(bart_dir, cache, REPO)
    repo = cache / ("models--" + REPO.replace("/", "--"))
    (repo / "x").write_text(str(second_bart))  # what refs/../x reads
    with pytest.raises(ValueError, match=r"revision=.*may not leave the Hub cache's refs/ directory") as e:
        resolve_checkpoint(REPO, revision=bad, download_dir=str(cache))
    assert f"(of model='{REPO}')" in str(e.value) and repr(bad) in str(e.value)
    with pytest.raises(ValueError, match=r"^tokenizer_revision=.*may not leave the Hub cache's refs/"):
        llm(REPO, tokenizer=REPO, tokenizer_revision=bad, download_dir=str(cache))


def test_a_climbing_revision_never_serves_a_checkpoint_from_outside_the_cache(bart_dir, second_bart, tmp_path,
                                                                             offline):
    cache = tmp_path / "cache"
    hub_cache(bart_dir, cache, REPO)
    (cache / ("models--" + REPO.replace("/", "--")) / "x").write_text(str(second_bart))
    with pytest.raises(ValueError, match=r"^revision='\.\./x': not a branch, tag or commit hash"):
        llm(REPO, revision="../x", download_dir=str(cache))


def test_branches_with_slashes_tags_and_commits_still_resolve(bart_dir, tmp_path, offline):
    cache = tmp_path / "cache"
    snapshot = hub_cache(bart_dir, cache, REPO, refs=("main", "v1.0"))
    refs = cache / ("models--" + REPO.replace("/", "--")) / "refs"
    for ref in ("refs/pr/1", "feature/x.y"):  # a pull request's ref is cached as refs/refs/pr/1
        (refs / ref).parent.mkdir(parents=True, exist_ok=True)
        (refs / ref).write_text(snapshot.name)
    for revision in ("v1.0", "refs/pr/1", "feature/x.y", snapshot.name):
        assert resolve_checkpoint(REPO, revision=revision, download_dir=str(cache)) == str(snapshot), revision


@pytest.mark.parametrize("name, why", [
    ("a" * 5000, r"too long for a local directory path or a Hugging Face Hub repo id \(at most 4096 characters\)"),
    ("org/" + "a" * 5000, r"too long for a local directory path"),
    ("a" * 300, r"not a local checkpoint directory \(File name too long\), nor a Hugging Face Hub repo id"),
    ("org/" + "b" * 300, r"not a local checkpoint directory, nor a Hugging Face Hub repo id \('org/name'\): "
                         r"Repo id must .* the maximum length is 96: it\.$"),
])
def test_an_overlong_model_name_is_a_clear_error_that_shows_it_cut(name, why, bart_dir, tmp_path, offline):
    """The file system's own refusal (ENAMETOOLONG, an OSError) named nothing; the value is
    shown cut, with its length, so the message stays short."""
    with pytest.raises(ValueError, match=why) as e:
        llm(name, download_dir=str(tmp_path))
    message = str(e.value)
    assert message.startswith("model='" + name[:20]) and f"({len(name)} characters)" in message
    assert len(message) < 400, len(message)
    with pytest.raises(ValueError, match=r"^tokenizer='.*" + why):
        llm(str(bart_dir), tokenizer=name, download_dir=str(tmp_path))


def test_allow_patterns_take_what_tandem_reads_and_bin_only_without_safetensors(bart_dir):
    saved = sorted(p.name for p in bart_dir.iterdir())
    assert set(filter_repo_objects(saved, allow_patterns=allow_patterns(saved))) == set(saved)
    repo = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "tf_model.h5", "flax_model.msgpack", "onnx/model.safetensors", "spiece.model", "source.spm",
            "target.spm", "sentencepiece.bpe.model", "preprocessor_config.json", "README.md", "training_args.bin"]
    kept = set(filter_repo_objects(repo, allow_patterns=allow_patterns(repo)))
    assert kept == {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                    "model-00002-of-00002.safetensors", "model.safetensors.index.json", "spiece.model",
                    "source.spm", "target.spm", "sentencepiece.bpe.model", "preprocessor_config.json"}
    bin_only = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json", "vocab.json",
                "merges.txt", "training_args.bin"]
    assert set(filter_repo_objects(bin_only, allow_patterns=allow_patterns(bin_only))) == set(bin_only) - {
        "training_args.bin"}
    assert not set(filter_repo_objects(repo, allow_patterns=allow_patterns(repo, weights=False))) & {
        "model.safetensors.index.json", "pytorch_model.bin"}


def _response(status: int):
    """A response of the HTTP library huggingface_hub's errors are built on."""
    from huggingface_hub import errors

    cls = errors.Response
    url = f"https://huggingface.co/api/models/{REPO}"
    try:
        lib = sys.modules[cls.__module__.split(".")[0]]
        return cls(status, request=lib.Request("GET", url))
    except TypeError:  # requests: a bare Response
        response = cls()
        response.status_code, response.url = status, url
        return response


def test_hub_errors_name_the_id_and_what_to_do():
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    gated = hub_error(GatedRepoError("403 Client Error", response=_response(403)), "model", REPO, None)
    assert f"model='{REPO}'" in str(gated) and "gated" in str(gated) and "HF_TOKEN" in str(gated)
    assert f"https://huggingface.co/{REPO}" in str(gated)
    missing = hub_error(RepositoryNotFoundError("404 Client Error", response=_response(404)), "tokenizer", REPO, None)
    assert str(missing).startswith(f"tokenizer='{REPO}': no such local directory, and no Hugging Face Hub repo")
    assert "HF_TOKEN" in str(missing)
    private = hub_error(HfHubHTTPError("401 Client Error", response=_response(401)), "model", REPO, None)
    assert "private" in str(private) and "HF_TOKEN" in str(private)
    rev = hub_error(RevisionNotFoundError("404 Client Error", response=_response(404)), "model", REPO, "v9")
    assert str(rev) == f"model='{REPO}': the Hugging Face Hub repo has no revision 'v9' (a branch, tag or commit " \
                       "hash): check `revision`"
    down = hub_error(HfHubHTTPError("503 Server Error\nmore", response=_response(503)), "model", REPO, None)
    assert str(down) == f"model='{REPO}': cannot fetch it from the Hugging Face Hub (HTTP 503): 503 Server Error"


def test_a_generation_config_by_repo_id(bart_dir, tmp_path, offline):
    """``generation_config=<repo id>`` reads that repo's generation_config.json from the cache,
    as a directory holding the same file does; missing from the cache, the error names it."""
    gen = tmp_path / "gen"  # another checkpoint's repo: its config.json and generation config
    gen.mkdir()
    shutil.copy(bart_dir / "config.json", gen / "config.json")
    (gen / "generation_config.json").write_text(json.dumps(
        {"decoder_start_token_id": 2, "eos_token_id": 2, "num_beams": 3, "max_length": 9, "no_repeat_ngram_size": 2}))
    cache = tmp_path / "cache"
    snapshot = hub_cache(gen, cache, "org/gen-config")
    by_id = llm(str(bart_dir), generation_config="org/gen-config", download_dir=str(cache))
    assert by_id.engine.config.generation_config == str(snapshot)
    by_dir = llm(str(bart_dir), generation_config=str(gen))
    defaults = by_id.get_default_sampling_params()
    assert defaults == by_dir.get_default_sampling_params()
    assert (defaults.num_beams, defaults.no_repeat_ngram_size) == (3, 2)  # the repo's file, not the checkpoint's
    assert token_ids(by_id) == token_ids(by_dir)
    with pytest.raises(ValueError, match=r"generation_config='org/not-cached'.*HF_HUB_OFFLINE"):
        llm(str(bart_dir), generation_config="org/not-cached", download_dir=str(cache))


def _tandem(*args, env):
    return subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.slow
def test_cli_generate_by_repo_id_from_hf_home_offline(bart_dir, tmp_path):
    home = tmp_path / "hf_home"
    hub_cache(bart_dir, home / "hub", REPO)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": NOWHERE}
    env.pop("HF_HUB_CACHE", None)
    res = _tandem("generate", "--model", REPO, "--dtype", "float32", "--device", "cpu", "--json", "--max-tokens", "8",
                  *PROMPTS, env=env)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line)["token_ids"] for line in res.stdout.splitlines()]
    assert got == token_ids(llm(str(bart_dir)))
    res = _tandem("generate", "--model", "org/absent", "the rain", env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "model='org/absent': no such local directory, and not in the Hugging Face cache" in res.stderr and "HF_HUB_OFFLINE is set" in res.stderr


def test_async_llm_by_repo_id(bart_dir, tmp_path, offline):
    from tandem import AsyncLLM

    snapshot = hub_cache(bart_dir, tmp_path / "cache", REPO)
    engine = AsyncLLM(REPO, start=False, download_dir=str(tmp_path / "cache"), dtype="float32", device="cpu")
    assert engine.engine.config.model == REPO and engine.engine.config.model_path == str(snapshot)


@pytest.mark.slow
def test_cli_transcribe_by_repo_id_from_hf_home_offline(tmp_path):
    pytest.importorskip("soundfile")
    import soundfile as sf

    from helpers import make_whisper, synth_audio

    whisper = make_whisper(tmp_path / "whisper", num_mel_bins=80, seed=4)
    home = tmp_path / "hf_home"
    hub_cache(whisper, home / "hub", "org/tiny-whisper")
    clip = synth_audio(3.0, seed=2)
    wav = tmp_path / "a.wav"
    sf.write(wav, clip, 16000)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": NOWHERE}
    env.pop("HF_HUB_CACHE", None)
    res = _tandem("transcribe", "org/tiny-whisper", str(wav), "--format", "json", "--language", "de", "--no-progress",
                  "--dtype", "float32", "--device", "cpu", env=env)
    assert res.returncode == 0, res.stderr
    expected = llm(str(whisper)).transcribe({"audio": clip, "sampling_rate": 16000}, language="de", use_tqdm=False)
    assert json.loads(res.stdout)["token_ids"] == expected[0].token_ids
