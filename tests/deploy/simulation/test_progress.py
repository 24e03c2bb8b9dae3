"""A long simulation's progress: a bar redrawn in place on a terminal, plain lines in a log, nothing with --quiet."""

import io

import pytest

from deploy.cli.main import main
from deploy.simulation.progress import Progress

pytestmark = pytest.mark.unit


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_plain_line_per_report():
    log = io.StringIO()
    progress = Progress("off, 40 blocks, round-robin", 1_000, log)
    assert not progress.due(), "the first line waits its interval"
    progress.show(250, 1234.4, 0.5, 3.2)
    progress.close(1_000, 5000.0, 0.75, 9.0)
    assert log.getvalue().splitlines() == [
        "[simulate] off, 40 blocks, round-robin: 250/1,000 answered, 1,234 s simulated, hit rate 0.500, 3 s",
        "[simulate] off, 40 blocks, round-robin: 1,000/1,000 answered, 5,000 s simulated, hit rate 0.750, 9 s"]


def test_a_terminal_gets_a_bar_redrawn_in_place():
    tty = _Terminal()
    progress = Progress("staging, cache-aware", 1_000, tty)
    progress.show(250, 1234.4, 0.5, 3.2)
    drawn = tty.getvalue()
    assert "\r" in drawn and "\n" not in drawn, "redrawn on its line"
    assert "25%" in drawn and "250/1.00k" in drawn and "hit rate 0.500" in drawn and "[simulate]" not in drawn
    progress.close(1_000, 5000.0, 0.75, 9.0)
    assert "100%" in tty.getvalue() and tty.getvalue().endswith("\n"), "the closed bar ends its line"


ARGS = ["simulate", "--model", "glm-5.2", "--tp", "8", "--block-size", "64", "--synthetic", "--conversations", "3",
        "--turns", "2", "--rate", "0", "--think-s", "0", "--system-tokens", "256", "--first-tokens", "256",
        "--output-tokens", "32", "--blocks", "40", "--modes", "off", "--max-model-len", "2048"]


def test_the_cli_reports_progress_on_stderr_unless_quiet(capsys):
    assert main(ARGS) == 0
    err = capsys.readouterr().err.splitlines()
    assert err and err[-1].startswith("[simulate] off, 40 blocks, round-robin: 6/6 answered, "), err
    assert main([*ARGS, "--quiet"]) == 0
    assert capsys.readouterr().err == ""
