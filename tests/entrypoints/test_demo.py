"""``tandem demo`` (the word-reversal BART): words outside its vocabulary are named as
such, not run and reported WRONG; ``--say`` / ``--save`` belong to ``--whisper``."""

from tandem.entrypoints.cli import DEMO_MODEL, main


def test_unknown_words_are_named_not_marked_wrong(capsys):
    assert main(["demo", "--dtype", "float32", "the cat sat", "the zebra sat on Mars"]) == 1
    out = capsys.readouterr().out
    assert "output: sat cat the\n  right" in out
    assert ("not run: 'zebra', 'Mars' are not in the demo model's vocabulary (371 lowercase words; "
            f"see {DEMO_MODEL / 'TRAINING.md'})") in out
    assert "WRONG" not in out
    assert "1/1 right; 1 not run (words outside the vocabulary)" in out


def test_only_unknown_words_is_a_usage_error(capsys):
    assert main(["demo", "hello"]) == 2
    out = capsys.readouterr().out
    assert "'hello' is not in the demo model's vocabulary" in out and "0/0 right; 1 not run" in out


def test_say_needs_whisper(capsys):
    assert main(["demo", "--say", "one two"]) == 2
    assert "--say and --save are for the Whisper demo" in capsys.readouterr().err
