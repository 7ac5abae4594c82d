"""README's two commands are what a new user types: command 2 works on a fresh environment
after command 1 (it installs what the tests need), and CI's last step is command 2 exactly."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _two_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", section, flags=re.M | re.S)
    assert len(blocks) == 2, blocks
    return [b.strip() for b in blocks]


def test_command_2_installs_the_test_extra_then_runs_the_suite_on_one_line():
    install, test = _two_commands()
    assert "\n" not in test
    assert test == "pip install -e '.[test]' && python -m pytest -q"
    assert "pip install -e ." in install  # command 2's editable install is command 1's, plus the extra
    extra = re.search(r"^test = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S).group(1)
    assert re.search(r'"pytest[>=<~ ]', extra)  # no tomllib on Python 3.10


def test_ci_runs_exactly_the_readmes_test_command_last():
    _, test = _two_commands()
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [ln for ln in lines if ln and not ln.startswith("#")]
    assert commands[-1] == test
