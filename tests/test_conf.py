"""board.conf: the one declaration of every setting, and the only reader of them."""

from __future__ import annotations

import ast
import importlib.util
import io
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from board import conf

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("board", "access", "escalations", "taskboard")
# The declarations, and Django's settings module, which builds its settings from them.
READERS = {ROOT / "board" / "conf.py", ROOT / "taskboard" / "settings.py"}

# What taskboard/settings.py gave each variable when the environment left it unset, before
# the declarations moved into board.conf.
DEFAULTS_BEFORE: dict[str, Any] = {
    "DEBUG": False,
    "ALLOWED_HOSTS": ["localhost", "127.0.0.1", "[::1]"],
    "CSRF_TRUSTED_ORIGINS": [],
    "TASKBOARD_HTTPS": False,
    "TASKBOARD_HSTS_SECONDS": 365 * 24 * 3600,
    "TASKBOARD_LEASE_SECONDS": 120,
    "TASKBOARD_MAX_FAILURES": 3,
    "TASKBOARD_MAX_ATTEMPT_SECONDS": None,
    "DATABASE_CONN_MAX_AGE": 300,
    "TASKBOARD_THREADS": 4,
    "TASKBOARD_BODY_TIMEOUT": 30,
    "TASKBOARD_HEADER_TIMEOUT": 10,
    "DATABASE_LISTEN_URL": "",
    "GRIP_URL": "",
    "TASKBOARD_STREAM_BUFFER_BYTES": 64 * 2**20,
    "TASKBOARD_HELD_STREAM_RECHECK_SECONDS": 600,
    "DATABASE_CONNECT_TIMEOUT": 5,
    "DATABASE_HEALTH_CHECKS": True,
    "TASKBOARD_HEALTH_TIMEOUT": 3,
    "TASKBOARD_TOKEN_CACHE_SECONDS": 10,
    "TASKBOARD_METRICS_PUBLIC": False,
    "TASKBOARD_MCP_SESSION_IDLE_SECONDS": 120,
    "TASKBOARD_AUTH_FAILURE_LIMIT": 30,
    "TASKBOARD_AUTH_FAILURE_WINDOW_SECONDS": 60,
    "TASKBOARD_CREATE_RATE": 6000,
    "TASKBOARD_COMMENT_RATE": 600,
    "HOST": "127.0.0.1",
    "PORT": 8000,
    "WEB_CONCURRENCY": None,
    "TASKBOARD_WORKER_TIMEOUT": 30,
    "TASKBOARD_SERVE_SOCKETS": "",
    "LOG_LEVEL": "INFO",
    "FORWARDED_ALLOW_IPS": [],
    "PROMETHEUS_MULTIPROC_DIR": "",
    "TASKBOARD_PUBLIC_URL": "http://127.0.0.1:8000",
    "TASKBOARD_WEBHOOK_TIMEOUT_SECONDS": 10,
    "TASKBOARD_WEBHOOK_ALLOW_PRIVATE": False,
    "TASKBOARD_DELIVERY_BACKOFF_SECONDS": 10,
    "TASKBOARD_DELIVERY_MAX_BACKOFF_SECONDS": 3600,
    "TASKBOARD_DELIVERY_HORIZON_SECONDS": 24 * 3600,
    "EMAIL_URL": "",
    "TASKBOARD_ESCALATION_EMAILS": [],
    "DEFAULT_FROM_EMAIL": "taskboard@localhost",
    "EMAIL_TIMEOUT": 10,
    # Added with humans in the loop (the contract names these defaults).
    "TASKBOARD_ANSWER_WITHIN": 86400,
    "TASKBOARD_ANSWER_HOLD_SECONDS": 300,
}


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for setting in conf.declared():
        monkeypatch.delenv(setting.env, raising=False)


def test_every_declared_setting_is_a_row_of_the_generated_table() -> None:
    rows = conf.markdown_table().splitlines()[2:]

    assert [row.split(" | ")[0] for row in rows] == [f"| `{s.env}`" for s in conf.declared()]
    for setting, row in zip(conf.declared(), rows, strict=True):
        assert setting.description and row.endswith(f"| {setting.description} |")


def test_the_configuration_command_prints_the_table() -> None:
    out = io.StringIO()
    call_command("configuration", stdout=out)

    assert out.getvalue() == conf.markdown_table()


def test_the_settings_page_is_the_table_with_its_text_around_it() -> None:
    spec = importlib.util.spec_from_file_location("hooks", ROOT / "docs" / "scripts" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()

    assert page.count(hooks.SETTINGS_TABLE) == 1
    assert conf.markdown_table() in hooks.with_settings_table(page)


def test_the_readme_sends_to_the_settings_page_and_keeps_no_table_of_its_own() -> None:
    readme = (ROOT / "README.md").read_text()

    assert "(docs/reference/settings.md)" in readme
    assert "| variable |" not in readme
    assert not [s.env for s in conf.declared() if f"| `{s.env}` |" in readme]


@pytest.mark.usefixtures("unset")
def test_the_defaults_are_what_the_settings_were_before() -> None:
    declared = {s.env: s for s in conf.declared()}
    # Defaults that depend on the rest (the data directory, a generated key, the database).
    computed = {"DATABASE_URL", "TASKBOARD_DATA_DIR", "SECRET_KEY", "DATABASE_PREPARED_STATEMENTS"}

    assert set(declared) == set(DEFAULTS_BEFORE) | computed
    assert {env: declared[env].from_environment() for env in DEFAULTS_BEFORE} == DEFAULTS_BEFORE


@pytest.mark.usefixtures("unset")
def test_an_empty_variable_is_unset_for_a_number_and_none_for_a_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TASKBOARD_LEASE_SECONDS", "")
    monkeypatch.setenv("ALLOWED_HOSTS", "")

    assert conf.lease_seconds.from_environment() == 120
    assert conf.allowed_hosts.from_environment() == []


@pytest.mark.parametrize(
    ("setting", "text", "said"),
    [
        (conf.lease_seconds, "0", "TASKBOARD_LEASE_SECONDS must be from 1 to 86400, not '0'"),
        (conf.threads, "four", "TASKBOARD_THREADS must be an integer, not 'four'"),
        (conf.body_timeout, "0", "TASKBOARD_BODY_TIMEOUT must be 1 or more, not '0'"),
        (conf.https, "maybe", "TASKBOARD_HTTPS must be a boolean (1/0, true/false), not 'maybe'"),
        (
            conf.max_attempt_seconds,
            "604801",
            "TASKBOARD_MAX_ATTEMPT_SECONDS must be from 1 to 604800, or unset, not '604801'",
        ),
        (
            conf.log_level,
            "loud",
            "LOG_LEVEL must be critical, error, warning, info or debug, not 'loud'",
        ),
        (conf.grip_url, "pushpin:5561", "GRIP_URL must be an http or https URL"),
        (conf.forwarded_allow_ips, "10.0.0.0/33", "not '10.0.0.0/33'"),
        (conf.escalation_emails, "ops@example.com,nobody", "comma-separated: not 'nobody'"),
        (conf.database_listen_url, "bogus", "DATABASE_LISTEN_URL is not a URL it can use"),
    ],
)
def test_a_bad_value_is_refused_with_a_line_that_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, setting: conf.Setting[Any], text: str, said: str
) -> None:
    monkeypatch.setenv(setting.env, text)

    with pytest.raises(ImproperlyConfigured) as refused:
        setting.from_environment()

    assert said in str(refused.value)


def test_a_setting_is_read_when_called_so_that_a_test_may_override_it(settings: Any) -> None:
    settings.TASKBOARD_LEASE_SECONDS = 7
    settings.TASKBOARD_BODY_TIMEOUT = 0.5

    assert conf.lease_seconds() == 7
    assert conf.body_timeout() == 0.5


def direct_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Return (line, name) for each declared setting that ``tree`` reads from Django's
    settings (``settings.X``, ``getattr(settings, "X")``) or from the environment
    (``os.environ.get("X")``, ``os.environ["X"]``, ``os.getenv("X")``)."""
    attributes = {s.attribute for s in conf.declared() if s.attribute}
    variables = {s.env for s in conf.declared()}

    def name_of(node: ast.AST) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        return ""

    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and name_of(node.value) == "settings"
            and node.attr in attributes
        ):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and node.args:
            first = node.args[0]
            calls = name_of(node.func)
            owner = name_of(node.func.value) if isinstance(node.func, ast.Attribute) else ""
            if (
                calls == "getattr"
                and name_of(first) == "settings"
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in attributes
            ):
                found.append((node.lineno, str(node.args[1].value)))
            elif (
                (calls == "getenv" or (calls in {"get", "pop"} and owner == "environ"))
                and isinstance(first, ast.Constant)
                and first.value in variables
            ):
                found.append((node.lineno, str(first.value)))
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and name_of(node.value) == "environ"
            and isinstance(node.slice, ast.Constant)
            and node.slice.value in variables
        ):
            found.append((node.lineno, str(node.slice.value)))
    return found


def test_no_other_module_reads_a_declared_setting_by_itself() -> None:
    reads = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in READERS
        for line, name in direct_reads(ast.parse(path.read_text()))
    ]

    assert reads == []


def test_a_direct_read_is_found_when_there_is_one() -> None:
    source = """
import os
from django.conf import settings
a = settings.TASKBOARD_THREADS
b = getattr(settings, "TASKBOARD_LEASE_SECONDS", 120)
c = os.environ.get("GRIP_URL")
d = os.environ["LOG_LEVEL"]
e = os.getenv("PORT")
settings.GRIP_URL = os.environ["GRIP_URL"] = "http://pushpin"
f = settings.SESSION_COOKIE_NAME
"""
    assert [name for _, name in direct_reads(ast.parse(source))] == [
        "TASKBOARD_THREADS",
        "TASKBOARD_LEASE_SECONDS",
        "GRIP_URL",
        "LOG_LEVEL",
        "PORT",
    ]
