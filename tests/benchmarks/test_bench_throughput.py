"""benchmarks/throughput.py on a tiny random BART: the sweep keeps each engine's
fastest setting and reports it, the latency workload's p50/p99 per round, and
the best/median figures agree with the runs they come from."""

import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import throughput  # noqa: E402


def test_latency_figures_are_percentiles_of_ms_per_token():
    outputs = [[0] * 4, [0] * 2, [0] * 8, [0] * 4, [0] * 5]
    seconds = [0.04, 0.01, 0.2, 0.02, 0.5]
    per_token = [1000 * s / len(o) for o, s in zip(outputs, seconds)]  # 10, 5, 25, 5, 100 ms
    p50, p99 = throughput.latency_figures(outputs, seconds)
    assert p50 == pytest.approx(np.percentile(per_token, 50)) == pytest.approx(10.0)
    assert p99 == pytest.approx(np.percentile(per_token, 99))


def test_one_at_a_time_serves_and_times_each_request_alone():
    w = throughput.WORKLOADS["latency"]
    requests = throughput.Requests(w, [[0, 5, 2], [0, 6, 7, 2], [0, 9, 2]], [2, 0])
    seen = []

    def run(single):
        seen.append(single.encoder_ids)
        return [[len(single.encoder_ids[0])]]

    outputs, seconds = throughput.one_at_a_time(run, requests)
    assert seen == [[[0, 5, 2]], [[0, 6, 7, 2]], [[0, 9, 2]]]
    assert outputs == [[3], [4], [3]] and len(seconds) == 3 and all(s >= 0 for s in seconds)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("ctranslate2")
    out = tmp_path_factory.mktemp("throughput") / "results.json"
    assert throughput.main([
        "--make-model", "tiny", "--workload", "translation,latency",
        "--num-prompts", "3", "--engines", "tandem,hf,ct2", "--repeat", "2", "--threads", "1",
        "--batch-sizes", "1,2,8", "--ct2-threads", "1x1,1x2", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    results = {"environment": payload["environment"]}
    for r in payload["results"]:
        results.setdefault(r["workload"], {})[r["engine"]] = r
    return results


@pytest.mark.slow  # ~30-70 s on 2 shared cores: three engines, two workloads, both sweeps
def test_the_sweep_keeps_each_engines_fastest_setting(tiny_run):
    r = tiny_run["translation"]
    # 8 is capped to the 3 requests; every CTranslate2 batch size under both thread layouts.
    assert set(r["hf"]["sweep"]) == {"batch 1", "batch 2", "batch 3"}
    assert set(r["ct2"]["sweep"]) == {f"batch {b}, {t} threads" for b in (1, 2, 3) for t in ("1x1", "1x2")}
    assert set(r["tandem"]["sweep"]) == {"default"}
    for engine in ("hf", "ct2", "tandem"):
        res = r[engine]
        sweep = res["sweep"]
        assert res["setting"] == min(sweep, key=sweep.get)
        # the kept setting's round-1 run is one of its runs; one run per round
        assert res["runs"][0] == sweep[res["setting"]] and len(res["runs"]) == 2
        tokens = res["output_tokens"]
        assert tokens == 3 * 48
        assert res["tokens_per_s"] == pytest.approx(tokens / statistics.median(res["runs"]))
        assert res["best_tokens_per_s"] == pytest.approx(tokens / min(res["runs"]))
    assert r["tandem"]["ratio_vs_ct2"] == pytest.approx(r["tandem"]["tokens_per_s"] / r["ct2"]["tokens_per_s"])
    assert tiny_run["environment"]["ct2_threads"] == "1x1,1x2"


@pytest.mark.slow  # shares the run above
def test_latency_reports_p50_and_p99_per_round(tiny_run):
    r = tiny_run["latency"]
    assert r["hf"]["setting"] == "batch 1"
    assert set(r["ct2"]["sweep"]) == {"batch 1, 1x1 threads", "batch 1, 1x2 threads"}
    for engine in ("hf", "ct2", "tandem"):
        res = r[engine]
        assert len(res["p50_ms"]) == len(res["p99_ms"]) == 2 == len(res["runs"])
        assert all(0 < p50 <= p99 for p50, p99 in zip(res["p50_ms"], res["p99_ms"]))
        # p50 ms/token of one round cannot exceed the round's whole time spread over its slowest token count
        assert all(p50 <= 1000 * run / 64 for p50, run in zip(res["p50_ms"], res["runs"]))
        assert res["sweep"][res["setting"]] == res["p50_ms"][0]
        assert res["output_tokens"] == 3 * 64
    assert r["tandem"]["ratio_vs_ct2"] == pytest.approx(
        statistics.median(r["ct2"]["p50_ms"]) / statistics.median(r["tandem"]["p50_ms"]))


def test_tandem_runs_with_its_caches_off(tmp_path):
    """Every round repeats the same requests: with the encoder cache on, tandem's rounds
    after the first skipped the encoder runs the other engines compute."""
    from tandem.core.config import EngineConfig

    model = throughput.make_model("tiny", str(tmp_path / "m"), 0)
    args = throughput.parse_args(["--model", model, "--engines", "tandem", "--threads", "1"])
    for cls in (throughput.TandemRunner, throughput.TandemNoScreenRunner):
        runner = cls(model, args)
        config: EngineConfig = runner.llm.llm_engine.config
        assert config.encoder_cache_blocks == 0 and config.prefix_cache_blocks == 0
        assert config.lm_head_screen == ("off" if cls is throughput.TandemNoScreenRunner else "auto")
        w = throughput.Workload("t", 2, 5, 5, 3)
        requests = throughput.Requests(w, [[0, 5, 6, 7, 2], [0, 8, 9, 10, 2]], [2, 0])
        first = runner.run(requests)
        assert runner.run(requests) == first
        # The second round ran the encoder again: no finished request's table was kept or found.
        bm = runner.llm.llm_engine.block_manager
        assert len(bm.encoder_cache) == 0 and bm.encoder_cache_hits == 0
