"""benchmarks/whisper.py: a row per --new-tokens count (64 and 128 by default),
best and median per row, tandem's ratio to the best peer of its precision."""

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import whisper as bench  # noqa: E402


def _row(engine, n, times):
    return bench.make_result(engine, [None] * 2, n, times, [[1] * n, [2] * n], 0.0)


def test_new_tokens_default_is_64_and_128_and_a_list_is_parsed():
    assert bench.parse_args([]).new_tokens == [64, 128]
    assert bench.parse_args(["--new-tokens", "128,32"]).new_tokens == [128, 32]
    with pytest.raises(SystemExit):
        bench.parse_args(["--new-tokens", "64,300"])  # above CTranslate2's 224


def test_rows_report_best_and_median_and_the_best_peer_of_the_same_precision():
    rows = [_row("tandem", 128, [3.0, 2.0, 4.0]), _row("tandem int8", 128, [2.0, 1.5]),
            _row("hf", 128, [6.0, 5.0]), _row("ct2 float32", 128, [4.0, 5.0, 3.0]),
            _row("ct2 int8", 128, [2.5, 3.5]), _row("tandem", 64, [1.0])]
    bench.compare(rows)
    tandem, tandem8, hf, ct2, ct28, tandem64 = rows
    assert tandem.best_audio_s_per_s == 60 / 2.0 and tandem.audio_s_per_s == 60 / 3.0
    # fp32 tandem against fp32 peers only: ct2 float32 is the best (3.0 best, 4.0 median)
    assert tandem.best_peer == "ct2 float32"
    assert tandem.ratio_vs_peer_best == pytest.approx(3.0 / 2.0)
    assert tandem.ratio_vs_peer == pytest.approx(4.0 / 3.0)
    # int8 tandem against every peer: ct2 int8 (2.5 best, 3.0 median)
    assert tandem8.best_peer == "ct2 int8"
    assert tandem8.ratio_vs_peer_best == pytest.approx(2.5 / 1.5)
    assert tandem8.ratio_vs_peer == pytest.approx(statistics.median([2.5, 3.5]) / 1.75)
    assert hf.ratio_vs_peer is None and hf.ratio_vs_hf == 1.0
    assert ct2.ratio_vs_hf == pytest.approx(5.5 / 4.0)
    assert tandem64.ratio_vs_hf is None and tandem64.best_peer == ""  # no peer at 64 tokens
    table = bench.format_table(rows)
    assert table.splitlines()[2].split()[:3] == ["tandem", "2", "64"]  # 64-token rows first


@pytest.mark.slow  # minutes on 2 shared cores: three engines, two token counts, two rounds
def test_a_tiny_run_has_a_row_per_engine_and_token_count(tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "w.json"
    assert bench.main(["--size", "tiny", "--num-clips", "1", "--new-tokens", "3,5", "--repeats", "2",
                       "--engines", "tandem,hf,ct2", "--ct2-compute-types", "float32",
                       "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {(r["engine"], r["tokens_per_clip"]): r for r in payload["results"]}
    assert set(rows) == {(e, n) for e in ("tandem", "hf", "ct2 float32") for n in (3, 5)}
    for r in rows.values():
        assert len(r["all_seconds"]) == 2
        assert r["best_audio_s_per_s"] == pytest.approx(30 / min(r["all_seconds"]))
        assert r["audio_s_per_s"] == pytest.approx(30 / statistics.median(r["all_seconds"]))
    assert set(payload["tandem_encoder_share"]) == {"3", "5", "stats"}
