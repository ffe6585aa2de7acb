"""The ``taskboard`` command's own part: the agent's commands, and the server's commands
taken from the ``taskboard.commands`` entry-point group, or refused in one line where no
distribution registered any (the agent's install alone)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from taskboard_agent import cli


@pytest.fixture
def agent_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an install of taskboard-agent alone: nothing in ``taskboard.commands``."""
    monkeypatch.setattr(cli, "entry_points", lambda group: [])


@pytest.mark.usefixtures("agent_only")
def test_a_server_command_is_refused_in_one_line_where_only_the_agent_side_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main(["createsuperuser"])

    out, err = capsys.readouterr()
    assert refused.value.code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("taskboard createsuperuser: not an agent command")
    assert "pip install -e ." in err


@pytest.mark.usefixtures("agent_only")
def test_help_lists_the_agent_commands_and_says_there_are_no_server_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])

    out, _ = capsys.readouterr()
    assert done.value.code == 0
    for name in ("work", "submit", "tasks", "mcp"):
        assert f"    {name} " in out
    assert "No server commands" in out


def test_any_other_command_goes_to_the_runner_registered_for_the_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[list[str]] = []
    registered = SimpleNamespace(name="server", load=lambda: ran.append)
    monkeypatch.setattr(cli, "entry_points", lambda group: [registered])

    cli.main(["migrate", "--plan"])
    cli.main([])

    assert ran == [["migrate", "--plan"], []]
    out, _ = capsys.readouterr()
    assert "Server commands" in out and "No server commands" not in out
