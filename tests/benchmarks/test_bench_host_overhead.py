"""benchmarks/host_overhead.py (issue 49): the bans checkpoint carries its bans in
generation_config.json and a broken ban is caught; the sweep's settings; tandem's
calls are counted over steady-state decode steps only; and a smoke run of every
variant and engine, each in its own process, gives HF's tokens and its figures."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import host_overhead  # noqa: E402
import throughput  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return host_overhead.make_checkpoints(str(tmp_path_factory.mktemp("host_overhead")), seed=0)


def test_the_bans_checkpoint_differs_only_in_its_generation_config(checkpoints):
    plain, bans = Path(checkpoints["plain"]), Path(checkpoints["bans"])
    assert checkpoints["beam4"] == checkpoints["plain"]
    assert (plain / "model.safetensors").read_bytes() == (bans / "model.safetensors").read_bytes()
    gen = json.loads((bans / "generation_config.json").read_text())
    config = throughput.load_config(str(plain))
    assert gen["no_repeat_ngram_size"] == 3
    assert len(gen["suppress_tokens"]) == 90 == len(set(gen["suppress_tokens"]))
    assert not set(gen["suppress_tokens"]) & throughput.special_ids(config)
    assert "suppress_tokens" not in json.loads((plain / "generation_config.json").read_text())
    assert config.d_model == 64 and config.vocab_size == 2000 and config.decoder_layers == 2


def test_a_broken_ban_is_caught():
    prompt = [2, 0]
    assert host_overhead.bans_broken([[5, 6, 7, 8], [9, 10, 11, 12]], prompt, [3, 4]) == ""
    assert "suppressed" in host_overhead.bans_broken([[5, 4, 7]], prompt, [3, 4])
    assert "3-gram" in host_overhead.bans_broken([[5, 6, 7, 5, 6, 7]], prompt, [3, 4])
    assert "3-gram" in host_overhead.bans_broken([[2, 0, 9, 2, 0, 9]], prompt, [3])  # the prompt counts


def test_settings_try_all_requests_in_one_batch_and_every_ct2_layout():
    args = host_overhead.parse_args(["--hf-batch-sizes", "32,512", "--ct2-batch-sizes", "64,256"])
    assert [label for label, _ in host_overhead.settings("hf", 256, 1, args)] == ["batch 32", "batch 256"]
    ct2 = host_overhead.settings("ct2", 256, 1, args)
    assert [label for label, _ in ct2] == ["batch 64, 2x1 threads", "batch 256, 2x1 threads",
                                           "batch 64, 1x2 threads", "batch 256, 1x2 threads"]
    assert ct2[-1][1] == {"batch_size": 256, "layout": (1, 2)}
    # tandem: one engine on every thread, and replicas sharing them (LLM's data_parallel_size), each
    # scheduling every step and in runs (num_scheduler_steps); beams only every step.
    assert host_overhead.settings("tandem", 256, 1, args) == [
        ("1 engine x 2 threads", {"data_parallel_size": 1, "num_scheduler_steps": 1}),
        ("1 engine x 2 threads, runs of 8", {"data_parallel_size": 1, "num_scheduler_steps": 8}),
        ("2 engines x 1 thread", {"data_parallel_size": 2, "num_scheduler_steps": 1}),
        ("2 engines x 1 thread, runs of 8", {"data_parallel_size": 2, "num_scheduler_steps": 8})]
    assert [s for _, s in host_overhead.settings("tandem", 64, 4, args)] == [
        {"data_parallel_size": 1, "num_scheduler_steps": 1}, {"data_parallel_size": 2, "num_scheduler_steps": 1}]
    four = host_overhead.parse_args(["--threads", "4", "--scheduler-steps", "1"])
    assert [s for _, s in host_overhead.settings("tandem", 256, 1, four)] == [
        {"data_parallel_size": d, "num_scheduler_steps": 1} for d in (1, 2, 4)]


def test_quick_gives_way_to_explicit_flags():
    args = host_overhead.parse_args(["--quick", "--requests", "6"])
    assert (args.requests, args.new_tokens, args.rounds, args.count_rows) == (6, 8, 1, [4, 16])
    assert host_overhead.parse_args(["--count-rows", "0"]).count_rows == []
    with pytest.raises(SystemExit):
        host_overhead.parse_args(["--variants", "plain,nope"])


def test_tandems_calls_are_counted_over_decode_steps_only(checkpoints):
    args = host_overhead.parse_args(["--new-tokens", "8"])
    config = throughput.load_config(checkpoints["plain"])
    engine = host_overhead.TandemEngine(checkpoints["plain"], seed=0)
    counts = engine.count_calls(host_overhead.variant_requests("plain", args, config, 3), skip=1, steps=2)
    assert counts["rows"] == counts["requests"] == 3 and counts["steps"] == 2
    assert counts["admission_steps"] >= 1 and counts["py_calls"] > 0 and counts["c_calls"] > 0
    assert not engine.llm.llm_engine.has_unfinished_requests()  # the counted requests were aborted


@pytest.mark.slow  # ~1-3 min on 2 shared cores: nine engine processes
def test_smoke_run_every_variant_and_engine(tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "host.json"
    assert host_overhead.main(["--quick", "--requests", "8", "--new-tokens", "6", "--hf-batch-sizes", "4",
                               "--ct2-batch-sizes", "8", "--count-rows", "4,8", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["guard_failures"] == []
    rows = {(r["variant"], r["engine"]): r for r in payload["results"]}
    assert set(rows) == {(v, e) for v in host_overhead.VARIANTS for e in host_overhead.ENGINES}
    for (variant, engine), r in rows.items():
        assert r["error"] == "" and len(r["runs"]) == 1, (variant, engine, r["error"])
        assert r["tokens"] == r["requests"] * 6 and r["requests"] == (2 if variant == "beam4" else 8)
        assert r["us_median"] == pytest.approx(1e6 * r["runs"][0] / r["tokens"])
        assert len({r["pid"] for r in rows.values()}) == 9  # a process per engine and variant
    assert rows[("plain", "tandem")]["same_as_hf"] == 8
    assert set(rows[("plain", "ct2")]["sweep"]) == {"batch 8, 2x1 threads", "batch 8, 1x2 threads"}
    counted = {(c["variant"], c["rows"]) for c in payload["counts"]}
    assert counted == {(v, n) for v in host_overhead.VARIANTS for n in (4, 8)}
    assert all(c["steps"] == 2 and c["py_calls"] > 0 for c in payload["counts"])
