"""The management commands that give agents and humans their API tokens."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from access import tokens
from access.models import ApiToken
from board.models import Capabilities, QueueLimit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_password_hashing")]


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def client_with(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def test_create_agent_prints_the_token_as_the_last_line() -> None:
    output = run("create_agent", "bot-1")

    token = output.splitlines()[-1]
    assert tokens.digest(token) == ApiToken.objects.get(user__username="bot-1").digest
    assert len(token) >= 32 and " " not in token


def test_create_agent_sets_and_clears_the_agents_capabilities() -> None:
    output = run("create_agent", "bot-caps", "--capabilities", "gpu, python,gpu")

    assert "offers: gpu, python" in output
    user = get_user_model().objects.get(username="bot-caps")
    assert Capabilities.objects.get(user=user).labels == ["gpu", "python"]
    run("create_agent", "bot-caps")
    assert Capabilities.objects.get(user=user).labels == ["gpu", "python"]
    run("create_agent", "bot-caps", "--capabilities", "")
    assert Capabilities.objects.get(user=user).labels == []
    with pytest.raises(CommandError, match="not a label"):
        run("create_agent", "bot-caps", "--capabilities", "Not A Label")


def test_the_token_create_agent_prints_authenticates_as_the_agent() -> None:
    token = run("create_agent", "bot-1").splitlines()[-1]

    response = client_with(token).post("/api/v1/tasks/", {"title": "hello"}, format="json")

    assert response.status_code == 201, response.content
    assert response.json()["created_by"] == "bot-1"


def test_create_agent_run_twice_reuses_the_user_with_a_new_token(settings: Any) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    first = run("create_agent", "bot-1").splitlines()[-1]
    assert client_with(first).get("/api/v1/tasks/").status_code == 200
    output = run("create_agent", "bot-1")
    second = output.splitlines()[-1]

    # The first token cannot be shown again (only its digest is kept): a new one replaces it.
    assert "Reusing agent 'bot-1'" in output
    assert first != second
    assert get_user_model().objects.filter(username="bot-1").count() == 1
    assert ApiToken.objects.filter(user__username="bot-1").count() == 1
    assert client_with(first).get("/api/v1/tasks/").status_code == 401
    assert client_with(second).get("/api/v1/tasks/").status_code == 200


def test_create_agent_gives_each_agent_its_own_token() -> None:
    first = run("create_agent", "bot-1").splitlines()[-1]
    second = run("create_agent", "bot-2").splitlines()[-1]

    assert first != second
    assert client_with(second).get("/api/v1/tasks/").status_code == 200


def test_an_agent_made_by_create_agent_has_no_password_to_log_in_with() -> None:
    run("create_agent", "bot-1")

    agent = get_user_model().objects.get(username="bot-1")
    assert not agent.has_usable_password()
    assert not agent.is_staff


@pytest.mark.parametrize(
    "name",
    [
        "two words",
        "slash/name",
        "semi;colon",
        "x" * 151,
        "",
        "   ",
    ],
)
def test_create_agent_refuses_an_invalid_username(name: str) -> None:
    with pytest.raises(CommandError):
        run("create_agent", name)

    assert not get_user_model().objects.exists()
    assert not ApiToken.objects.exists()


def test_drf_create_token_gives_a_human_a_working_token(staff: Any) -> None:
    output = run("drf_create_token", staff.username)

    match = re.fullmatch(rf"Generated token (\S+) for user {staff.username}\n", output)
    assert match, output
    token = match[1]
    assert tokens.digest(token) == ApiToken.objects.get(user=staff).digest
    response = client_with(token).get("/api/v1/tasks/")
    assert response.status_code == 200, response.content


def test_drf_create_token_will_not_show_an_existing_token_again(staff: Any) -> None:
    first = run("drf_create_token", staff.username).split()[2]

    with pytest.raises(CommandError, match="cannot be shown again: run with -r"):
        run("drf_create_token", staff.username)

    assert client_with(first).get("/api/v1/tasks/").status_code == 200


def test_drf_create_token_with_r_replaces_the_token(staff: Any, settings: Any) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    first = run("drf_create_token", staff.username).split()[2]

    output = run("drf_create_token", "-r", staff.username)

    second = output.split()[2]
    assert output == f"Generated token {second} for user {staff.username}\n"
    assert second != first
    assert client_with(first).get("/api/v1/tasks/").status_code == 401
    assert client_with(second).get("/api/v1/tasks/").status_code == 200


def test_drf_create_token_refuses_an_unknown_user() -> None:
    with pytest.raises(CommandError, match="user nobody does not exist"):
        run("drf_create_token", "nobody")


# -- create_agent --queues: agents limited to queues ---------------------------------------


def limit_of(name: str) -> list[str] | None:
    return QueueLimit.objects.filter(user__username=name).values_list("queues", flat=True).first()


def test_create_agent_without_queues_makes_an_agent_of_every_queue() -> None:
    run("create_agent", "bot-1")

    assert limit_of("bot-1") is None


def test_create_agent_with_queues_limits_the_agent_to_them() -> None:
    output = run("create_agent", "bot-1", "--queues", "images, video,images")

    assert limit_of("bot-1") == ["images", "video"]
    assert "images, video" in output
    token = output.strip().splitlines()[-1]
    assert tokens.digest(token) == ApiToken.objects.get(user__username="bot-1").digest


def test_create_agent_run_again_with_queues_changes_the_limit() -> None:
    run("create_agent", "bot-1", "--queues", "images")

    run("create_agent", "bot-1", "--queues", "video,audio")

    assert limit_of("bot-1") == ["audio", "video"]


def test_create_agent_run_again_without_queues_keeps_the_limit() -> None:
    run("create_agent", "bot-1", "--queues", "images")

    output = run("create_agent", "bot-1")

    assert limit_of("bot-1") == ["images"]
    assert "images" in output


def test_create_agent_with_all_queues_lifts_the_limit() -> None:
    run("create_agent", "bot-1", "--queues", "images")

    output = run("create_agent", "bot-1", "--all-queues")

    assert limit_of("bot-1") is None
    assert "every queue" in output


@pytest.mark.parametrize("queues", ["", " , ", "Images", "no spaces", "a/b", "x" * 65])
def test_create_agent_refuses_queues_that_are_no_queue_names(queues: str) -> None:
    with pytest.raises(CommandError):
        run("create_agent", "bot-1", "--queues", queues)

    assert not get_user_model().objects.exists()
    assert not QueueLimit.objects.exists()


def test_create_agent_refuses_queues_and_all_queues_together() -> None:
    with pytest.raises(CommandError):
        run("create_agent", "bot-1", "--queues", "a", "--all-queues")


def test_the_limit_create_agent_sets_is_what_the_api_applies() -> None:
    token = run("create_agent", "bot-1", "--queues", "images").strip().splitlines()[-1]
    client = client_with(token)

    allowed = client.post("/api/v1/tasks/", {"title": "a", "queue": "images"}, format="json")
    refused = client.post("/api/v1/tasks/", {"title": "b", "queue": "video"}, format="json")

    assert allowed.status_code == 201, allowed.content
    assert refused.status_code == 403
    assert refused.json()["error"] == "forbidden_queue"


# -- The command line as a user types it -------------------------------------------------


def taskboard(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``taskboard ARGS`` as a user would, in a fresh process, with ``env`` added."""
    from tests.processes import ROOT, tests_database_url

    environment = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    environment.update({"DATABASE_URL": tests_database_url(), **env})
    return subprocess.run(
        [sys.executable, "-m", "taskboard_agent.cli", *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_log_level_is_taken_in_any_case() -> None:
    """uvicorn's spelling (``debug``) is what many set; logging wants ``DEBUG``."""
    done = taskboard("check", LOG_LEVEL="debug")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("TASKBOARD_THREADS", "0", "TASKBOARD_THREADS must be 1 or more, not '0'"),
        ("TASKBOARD_LEASE_SECONDS", "0", "TASKBOARD_LEASE_SECONDS must be from 1 to 86400"),
        ("TASKBOARD_LEASE_SECONDS", "100000", "TASKBOARD_LEASE_SECONDS must be from 1 to 86400"),
        ("TASKBOARD_MAX_FAILURES", "101", "TASKBOARD_MAX_FAILURES must be from 1 to 100"),
        ("TASKBOARD_HEALTH_TIMEOUT", "0", "TASKBOARD_HEALTH_TIMEOUT must be 1 or more"),
        ("TASKBOARD_BODY_TIMEOUT", "0", "TASKBOARD_BODY_TIMEOUT must be 1 or more"),
        ("TASKBOARD_WORKER_TIMEOUT", "0", "TASKBOARD_WORKER_TIMEOUT must be from 1 to 86400"),
        ("TASKBOARD_TOKEN_CACHE_SECONDS", "-1", "TASKBOARD_TOKEN_CACHE_SECONDS must be 0 or"),
        ("DATABASE_CONNECT_TIMEOUT", "0", "DATABASE_CONNECT_TIMEOUT must be 1 or more"),
        ("TASKBOARD_STREAM_BUFFER_BYTES", "1000", "TASKBOARD_STREAM_BUFFER_BYTES must be from"),
        ("LOG_LEVEL", "bogus", "LOG_LEVEL must be critical, error, warning, info or debug"),
        ("DATABASE_URL", "bogus", "DATABASE_URL is not a URL it can use"),
        ("EMAIL_URL", "smtp://host:port:x", "EMAIL_URL is not a URL it can use"),
        ("EMAIL_URL", "notaurl", "EMAIL_URL is not a URL it can use: give smtp://host:port"),
        ("EMAIL_URL", "http://mail.example.com", "EMAIL_URL is not a URL it can use"),
        ("TASKBOARD_ESCALATION_EMAILS", "ops@example.com,notanemail", "not 'notanemail'"),
        ("TASKBOARD_WEBHOOK_TIMEOUT_SECONDS", "0", "TASKBOARD_WEBHOOK_TIMEOUT_SECONDS must be"),
        ("TASKBOARD_DELIVERY_BACKOFF_SECONDS", "-1", "TASKBOARD_DELIVERY_BACKOFF_SECONDS must"),
        ("TASKBOARD_DELIVERY_HORIZON_SECONDS", "0", "TASKBOARD_DELIVERY_HORIZON_SECONDS must"),
        ("DATABASE_LISTEN_URL", "bogus", "DATABASE_LISTEN_URL is not a URL it can use"),
        ("GRIP_URL", "bogus", "GRIP_URL must be an http or https URL"),
        ("TASKBOARD_THREADS", "four", "TASKBOARD_THREADS must be an integer, not 'four'"),
    ],
)
def test_a_bad_setting_is_refused_in_one_line_naming_it(name: str, value: str, said: str) -> None:
    # They crashed serve with a traceback, or served requests that then failed (a lease of
    # 0 s refused every claim as the client's fault).
    done = taskboard("check", **{name: value})

    assert done.returncode == 2
    assert said in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_escalation_addresses_may_carry_names_and_hosts_without_a_dot() -> None:
    done = taskboard("check", TASKBOARD_ESCALATION_EMAILS="Ops <ops@example.com>, oncall@intranet")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("name", "value"), [("PORT", "abc"), ("PORT", "70000"), ("WEB_CONCURRENCY", "0")]
)
def test_serve_refuses_a_bad_port_or_process_count_naming_the_variable(
    name: str, value: str
) -> None:
    done = taskboard("serve", "--help", **{name: value})

    assert done.returncode == 2
    assert done.stderr.startswith(f"taskboard serve: {name} must be")
    assert "Traceback" not in done.stderr


def test_serve_refuses_workers_below_one() -> None:
    done = taskboard("serve", "--workers", "0")
    assert done.returncode == 2 and "must be a number of processes, 1 or more" in done.stderr


def test_empty_host_and_port_variables_count_as_unset() -> None:
    done = taskboard("serve", "--help", PORT="", HOST="")
    assert done.returncode == 0, done.stderr
    assert "--port" in done.stdout


def test_help_names_every_command_it_lists_mcp_included() -> None:
    for command in ("mcp", "work", "submit", "tasks", "serve"):
        done = taskboard("help", command)
        assert done.returncode == 0, (command, done.stderr)
        assert "usage:" in done.stdout.lower(), (command, done.stdout)


def test_the_benchmark_and_the_soak_run_from_the_checkout_by_either_name() -> None:
    """``taskboard benchmark`` and ``soak`` find benchmarks/ next to the package (an editable
    install); ``python -m benchmarks [soak]`` runs the same commands."""
    from tests.processes import ROOT

    for command, module_args, option in (
        ("benchmark", [], "--quick"),
        ("soak", ["soak"], "--minutes"),
    ):
        by_name = taskboard(command, "--help")
        by_module = subprocess.run(
            [sys.executable, "-m", "benchmarks", *module_args, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        for done in (by_name, by_module):
            assert done.returncode == 0, done.stderr
            assert option in done.stdout


# -- A server command where there is no database, or none migrated -----------------------


def taskboard_in(
    directory: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``taskboard ARGS`` in ``directory`` as a user would there: no DATABASE_URL or
    TASKBOARD_DATA_DIR unless ``env`` sets them, and a runtime directory of its own (where
    running ``serve`` processes register: none here)."""
    runtime = directory.parent / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DJANGO_SETTINGS_MODULE", "DATABASE_URL", "TASKBOARD_DATA_DIR"}
    }
    environment.update({"XDG_RUNTIME_DIR": str(runtime), **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "taskboard_agent.cli", *args],
        cwd=directory,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


AGENT_COMMANDS = [
    ["create_agent", "my-agent"],
    ["createsuperuser", "--noinput", "--username", "root", "--email", "root@example.com"],
    ["drf_create_token", "root"],
]


@pytest.mark.parametrize("args", AGENT_COMMANDS, ids=lambda args: args[0])
def test_a_server_command_where_there_is_no_database_says_so_and_makes_none(
    tmp_path: Path, args: list[str]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    done = taskboard_in(elsewhere, *args)

    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"taskboard {args[0]}: no database in {elsewhere / '.taskboard'}, and no `taskboard "
        "serve` runs on an embedded database: run this where `taskboard serve` ran, or set "
        "TASKBOARD_DATA_DIR to the directory its banner names (`taskboard migrate` makes a "
        "new database here)"
    ]
    assert list(elsewhere.iterdir()) == [], "nothing made, an empty database least of all"


@pytest.fixture
def unmigrated_database() -> Iterator[str]:
    """Return the DATABASE_URL of a new, empty database on the tests' server."""
    import psycopg
    from django.db import connection

    from benchmarks.harness import ServerParams

    name = f"{connection.settings_dict['NAME']}_unmigrated"
    params = {k: v for k, v in connection.get_connection_params().items() if k != "cursor_factory"}
    for key in ("context", "prepare_threshold"):
        params.pop(key, None)
    with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
        try:
            yield ServerParams.from_django().url(name)
        finally:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize("args", AGENT_COMMANDS, ids=lambda args: args[0])
def test_a_server_command_on_a_database_not_migrated_says_what_to_run_in_one_line(
    tmp_path: Path, unmigrated_database: str, args: list[str]
) -> None:
    # It was a traceback of 67 lines ending in: relation "auth_user" does not exist.
    done = taskboard_in(tmp_path, *args, env={"DATABASE_URL": unmigrated_database})

    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"taskboard {args[0]}: the database (")
    assert "is not migrated" in line and "run `taskboard migrate` first" in line
    assert "unapplied migration" not in done.stdout, "Django's notice is not said as well"


def test_a_serve_that_is_gone_is_not_taken_for_a_running_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from taskboard.embedded import serving

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    killed = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                            capture_output=True, check=True)  # fmt: skip
    with serving.registered(tmp_path / "running"):
        # A serve killed with SIGKILL leaves its entry; a pid may be taken by a later process.
        (serving.registry() / killed.stdout.strip()).write_text(
            json.dumps({"data_dir": str(tmp_path / "killed"), "started": 1.0})
        )
        (serving.registry() / str(os.getppid())).write_text(
            json.dumps({"data_dir": str(tmp_path / "reused"), "started": 1.0})
        )

        assert serving.served() == [tmp_path / "running"]
        assert [entry.name for entry in serving.registry().iterdir()] == [str(os.getpid())]
    assert serving.served() == []


def test_with_two_serves_running_a_command_elsewhere_asks_which_database(tmp_path: Path) -> None:
    import psutil

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    registry = tmp_path / "runtime" / "taskboard" / "serving"
    registry.mkdir(parents=True)
    (tmp_path / "runtime").chmod(0o700)
    boards = [tmp_path / "a" / ".taskboard", tmp_path / "b" / ".taskboard"]
    for pid, board in zip([os.getpid(), os.getppid()], boards, strict=True):
        started = psutil.Process(pid).create_time()
        (registry / str(pid)).write_text(json.dumps({"data_dir": str(board), "started": started}))

    done = taskboard_in(elsewhere, "create_agent", "my-agent")

    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"taskboard create_agent: no database in {elsewhere / '.taskboard'}; `taskboard serve` "
        f"runs on {boards[0]}, {boards[1]}: set TASKBOARD_DATA_DIR to the one to use"
    ]
    assert list(elsewhere.iterdir()) == []
