"""Tokens stored hashed (access.tokens, access.admin) and failed authentication throttled
per client address (access.throttle), on the API, the stream and the login forms."""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from access import tokens
from access.models import ApiToken, AuthFailure
from tests.factories import StaffFactory, TokenFactory, UserFactory
from tests.live import LiveServer, live_server, relay_cut_off

TOKENS_URL = reverse("admin:access_apitoken_changelist")


def api_client(token: str | None = None, address: str = "127.0.0.1") -> APIClient:
    client = APIClient(REMOTE_ADDR=address)
    if token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def tables_holding(text: str) -> list[str]:
    """Return every table of the database that holds ``text`` in any column of any row."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT quote_ident(table_schema) || '.' || quote_ident(table_name) "
            "FROM information_schema.tables "
            "WHERE table_type = 'BASE TABLE' "
            "AND table_schema NOT IN ('pg_catalog', 'information_schema')"
        )
        tables = [name for (name,) in cursor.fetchall()]
        holding = []
        for table in tables:
            # A whole row cast to text holds every column's value.
            cursor.execute(f"SELECT 1 FROM {table} AS t WHERE strpos(t::text, %s) > 0", [text])
            if cursor.fetchone():
                holding.append(table)
        return holding


def fresh_window(seconds_needed: float = 10) -> None:
    """Wait, if need be, until the current throttle window has ``seconds_needed`` left, so
    that a test's failures all fall in one window."""
    from access import throttle

    window = throttle.window()
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM statement_timestamp())::float8")
        now = cursor.fetchone()[0]
    left = window - now % window
    if left < seconds_needed:
        time.sleep(left + 0.05)


# Tokens stored hashed


@pytest.mark.django_db
def test_no_table_holds_a_token_in_plain_text(settings: Any) -> None:
    out: list[str] = []
    for command in (["create_agent", "bot-1"], ["drf_create_token", "-r", "bot-1"]):
        from io import StringIO

        buffer = StringIO()
        call_command(*command, stdout=buffer)
        out.append(buffer.getvalue())
    agent_token = out[0].splitlines()[-1]
    human_token = out[1].split()[2]
    factory_token = str(TokenFactory.create(user=UserFactory.create(username="bot-2")).key)
    assert api_client(factory_token).get("/api/v1/tasks/").status_code == 200

    for token in (agent_token, human_token, factory_token):
        assert tables_holding(token) == []
    # The search finds what is there: the digest of the token in use.
    assert tables_holding(tokens.digest(factory_token)) == ["public.api_tokens"]


@pytest.mark.django_db
def test_drf_tokens_keep_working_after_the_migration_hashes_them(settings: Any) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    user = UserFactory.create(username="old-agent")
    key = "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:
        # DRF's rest_framework.authtoken table, as its migrations made it.
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, "
            "created timestamptz NOT NULL, user_id integer NOT NULL UNIQUE)"
        )
        cursor.execute(
            "INSERT INTO authtoken_token VALUES (%s, now() - interval '1 day', %s)", [key, user.pk]
        )
    migration = importlib.import_module("access.migrations.0001_initial")

    with connection.schema_editor() as editor:
        migration.hash_drf_tokens(None, editor)

    assert "authtoken_token" not in connection.introspection.table_names()
    assert ApiToken.objects.get(user=user).digest == tokens.digest(key)
    assert tables_holding(key) == []
    response = api_client(key).post("/api/v1/tasks/", {"title": "still me"}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["created_by"] == "old-agent"
    assert (
        api_client(key).get("/api/v1/tasks/", HTTP_AUTHORIZATION=f"Token {key}").status_code == 200
    )


@pytest.mark.django_db
def test_migrating_a_database_with_drf_tokens_hashes_them(settings: Any) -> None:
    from django.db.migrations.executor import MigrationExecutor

    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    user = UserFactory.create(username="older-agent")
    key = "fedcba9876543210fedcba9876543210fedcba98"
    executor = MigrationExecutor(connection)
    executor.migrate([("access", None)])  # back to before this app: no api_tokens
    assert "api_tokens" not in connection.introspection.table_names()
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, "
            "created timestamptz NOT NULL, user_id integer NOT NULL UNIQUE)"
        )
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, now(), %s)", [key, user.pk])

    executor = MigrationExecutor(connection)
    executor.migrate([("access", "0001_initial")])
    # And on to today's schema, which the migrations of other apps that came back with
    # this one's removal left (the tasks' columns of later migrations).
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())

    assert "authtoken_token" not in connection.introspection.table_names()
    assert tables_holding(key) == []
    assert api_client(key).get("/api/v1/tasks/").status_code == 200
    with connection.cursor() as cursor:
        cursor.execute("SELECT relpersistence FROM pg_class WHERE relname = 'auth_failures'")
        assert cursor.fetchone() == ("u",)  # UNLOGGED


@pytest.fixture
def token_admin(db: None) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", password="x"))
    return client


def shown_token(response: Any) -> str:
    [token] = [t.key for t in response.context["issued"]]
    assert token and token in response.content.decode()
    return str(token)


@pytest.mark.django_db
def test_staff_rotate_a_token_in_the_admin_and_see_the_new_one_once(
    token_admin: Client, agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    old = str(TokenFactory.create(user=agent).key)
    assert api_client(old).get("/api/v1/tasks/").status_code == 200

    response = token_admin.post(TOKENS_URL, {"action": "rotate", "_selected_action": [agent.pk]})

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    new = shown_token(response)
    assert new != old
    assert api_client(old).get("/api/v1/tasks/").status_code == 401
    assert api_client(new).get("/api/v1/tasks/").status_code == 200
    # Shown once: neither the list nor the token's page shows it again, and no table has it.
    for url in (TOKENS_URL, reverse("admin:access_apitoken_change", args=[agent.pk])):
        assert new not in token_admin.get(url).content.decode()
    assert tables_holding(new) == []


@pytest.mark.django_db
def test_the_rotate_button_on_a_tokens_page_rotates_it(
    token_admin: Client, agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    old = str(TokenFactory.create(user=agent).key)
    page = token_admin.get(reverse("admin:access_apitoken_change", args=[agent.pk]))
    rotate_url = reverse("admin:access_apitoken_rotate", args=[agent.pk])
    assert rotate_url in page.content.decode()

    assert token_admin.get(rotate_url).status_code == 405
    new = shown_token(token_admin.post(rotate_url))

    assert api_client(old).get("/api/v1/tasks/").status_code == 401
    assert api_client(new).get("/api/v1/tasks/").status_code == 200


@pytest.mark.django_db
def test_staff_issue_a_token_for_a_user_that_has_none(token_admin: Client, agent: Any) -> None:
    response = token_admin.post(reverse("admin:access_apitoken_add"), {"user": agent.pk})

    assert response.status_code == 200
    new = shown_token(response)
    assert api_client(new).get("/api/v1/tasks/").json()["results"] == []


@pytest.mark.django_db
def test_adding_a_token_for_a_user_that_has_one_replaces_nothing(
    token_admin: Client, agent: Any
) -> None:
    old = str(TokenFactory.create(user=agent).key)

    response = token_admin.post(reverse("admin:access_apitoken_add"), {"user": agent.pk})

    assert response.status_code == 200 and "issued" not in response.context
    assert "already exists" in response.content.decode()
    assert api_client(old).get("/api/v1/tasks/").status_code == 200


@pytest.mark.django_db
def test_staff_without_the_permission_cannot_rotate(agent: Any) -> None:
    TokenFactory.create(user=agent)
    client = Client()
    client.force_login(StaffFactory.create(username="ops-bob"))

    assert client.post(reverse("admin:access_apitoken_rotate", args=[agent.pk])).status_code == 403
    assert client.get(TOKENS_URL).status_code == 403


@pytest.mark.django_db
def test_only_a_superuser_issues_or_rotates_the_token_of_staff(agent: Any, settings: Any) -> None:
    """A token acts as its user: staff who may manage tokens must not become a superuser
    (or another staff member) by issuing or rotating that user's token."""
    from django.contrib.auth.models import Permission

    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    root = get_user_model().objects.create_superuser("root", password="x")
    root_token = str(TokenFactory.create(user=root).key)
    keeper = StaffFactory.create(username="ops-keeper")
    keeper.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_apitoken", "change_apitoken"])
    )
    client = Client()
    client.force_login(keeper)
    add_url = reverse("admin:access_apitoken_add")

    issue_for_staff = client.post(add_url, {"user": StaffFactory.create(username="ops-carol").pk})
    rotate_root = client.post(reverse("admin:access_apitoken_rotate", args=[root.pk]))
    rotate_many = client.post(TOKENS_URL, {"action": "rotate", "_selected_action": [root.pk]})
    issue_for_agent = client.post(add_url, {"user": agent.pk})

    assert issue_for_staff.status_code == 403
    assert rotate_root.status_code == 403
    assert rotate_many.status_code == 403
    assert api_client(root_token).get("/api/v1/tasks/").status_code == 200
    assert api_client(shown_token(issue_for_agent)).get("/api/v1/tasks/").status_code == 200


@pytest.mark.django_db
def test_staff_limited_to_queues_mint_tokens_only_of_users_within_their_queues(
    settings: Any,
) -> None:
    """A token reaches what its user reaches: staff limited to queue a who may manage
    tokens must not reach queue b by issuing or rotating the token of an unlimited agent,
    or of an agent of queue b."""
    from django.contrib.auth.models import Permission

    from board.access import limit_queues

    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    keeper = StaffFactory.create(username="ops-limited")
    keeper.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_apitoken", "change_apitoken"])
    )
    limit_queues(keeper, ["a"])
    unlimited = UserFactory.create(username="carol")
    unlimited_token = str(TokenFactory.create(user=unlimited).key)
    of_b = UserFactory.create(username="bob")
    limit_queues(of_b, ["b"])
    TokenFactory.create(user=of_b)
    of_a = UserFactory.create(username="alice")
    limit_queues(of_a, ["a"])
    TokenFactory.create(user=of_a)
    tokenless = UserFactory.create(username="dave")
    client = Client()
    client.force_login(keeper)

    rotate_unlimited = client.post(reverse("admin:access_apitoken_rotate", args=[unlimited.pk]))
    rotate_many = client.post(
        TOKENS_URL, {"action": "rotate", "_selected_action": [unlimited.pk, of_a.pk]}
    )
    rotate_of_b = client.post(reverse("admin:access_apitoken_rotate", args=[of_b.pk]))
    issue_unlimited = client.post(reverse("admin:access_apitoken_add"), {"user": tokenless.pk})
    rotate_of_a = client.post(reverse("admin:access_apitoken_rotate", args=[of_a.pk]))

    assert rotate_unlimited.status_code == 403
    assert rotate_many.status_code == 403
    assert rotate_of_b.status_code == 403
    assert issue_unlimited.status_code == 403
    assert not ApiToken.objects.filter(user=tokenless).exists()
    assert api_client(unlimited_token).get("/api/v1/tasks/").status_code == 200
    assert api_client(shown_token(rotate_of_a)).get("/api/v1/tasks/").status_code == 200


@pytest.mark.django_db
def test_staff_limited_to_a_queue_delete_and_list_only_tokens_of_users_within_it(
    settings: Any,
) -> None:
    """Deleting a token locks its user out: staff limited to queue qa who may delete
    tokens must not revoke the token of an agent of qb or of a superuser, one at a time or
    as a selection, nor see them in the list."""
    from django.contrib.auth.models import Permission

    from board.access import limit_queues

    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    root = get_user_model().objects.create_superuser("root", password="x")
    root_token = str(TokenFactory.create(user=root).key)
    keeper = StaffFactory.create(username="ops-limited")
    keeper.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_apitoken", "delete_apitoken"])
    )
    limit_queues(keeper, ["qa"])
    TokenFactory.create(user=keeper)
    of_qb = UserFactory.create(username="bob")
    limit_queues(of_qb, ["qb"])
    of_qb_token = str(TokenFactory.create(user=of_qb).key)
    unlimited = UserFactory.create(username="carol")
    unlimited_token = str(TokenFactory.create(user=unlimited).key)
    of_qa = UserFactory.create(username="alice")
    limit_queues(of_qa, ["qa"])
    TokenFactory.create(user=of_qa)
    client = Client()
    client.force_login(keeper)

    listed = client.get(TOKENS_URL)
    delete_of_qb = client.post(
        reverse("admin:access_apitoken_delete", args=[of_qb.pk]), {"post": "yes"}
    )
    delete_root = client.post(
        reverse("admin:access_apitoken_delete", args=[root.pk]), {"post": "yes"}
    )
    delete_many = client.post(
        TOKENS_URL,
        {
            "action": "delete_selected",
            "_selected_action": [root.pk, of_qb.pk, unlimited.pk, of_qa.pk],
            "post": "yes",
        },
    )

    assert listed.status_code == 200
    assert sorted(t.user.username for t in listed.context["cl"].result_list) == [
        "alice",
        "ops-limited",
    ]
    assert (delete_of_qb.status_code, delete_root.status_code) == (403, 403)
    assert delete_many.status_code == 403
    for token in (root_token, of_qb_token, unlimited_token):
        assert api_client(token).get("/api/v1/tasks/").status_code == 200
    assert ApiToken.objects.filter(user=of_qa).exists()

    # Those within the limit it may delete, one at a time or as a selection.
    delete_of_qa = client.post(
        TOKENS_URL, {"action": "delete_selected", "_selected_action": [of_qa.pk], "post": "yes"}
    )
    assert delete_of_qa.status_code == 302
    assert not ApiToken.objects.filter(user=of_qa).exists()
    assert ApiToken.objects.count() == 4


@pytest.mark.django_db
def test_the_token_list_shows_exactly_the_tokens_its_user_may_issue_or_rotate() -> None:
    """The list's filter (access.admin.manageable) is the rule of may_issue_for."""
    from access.admin import manageable, may_issue_for
    from board.access import limit_queues

    root = get_user_model().objects.create_superuser("root", password="x")
    users = [root]
    for name, staff, queues in [
        ("ops-ab", True, ["qa", "qb"]),
        ("ops-a", True, ["qa"]),
        ("ops-all", True, None),
        ("agent-a", False, ["qa"]),
        ("agent-ab", False, ["qa", "qb"]),
        ("agent-b", False, ["qb"]),
        ("agent-all", False, None),
    ]:
        user = (StaffFactory if staff else UserFactory).create(username=name)
        if queues:
            limit_queues(user, queues)
        users.append(user)
    for user in users:
        TokenFactory.create(user=user)
    users = list(get_user_model().objects.all())  # fresh, without cached queue limits

    for actor in users:
        listed = set(manageable(actor, ApiToken.objects.all()).values_list("user_id", flat=True))
        assert listed == {u.pk for u in users if may_issue_for(actor, u)}, actor.username


# Failed authentication throttled


def assert_throttled(response: Any) -> None:
    assert response.status_code == 429, response.content
    body = response.json()
    assert body["error"] == "throttled" and "Try again in" in body["detail"]
    assert 1 <= int(response["Retry-After"]) <= 60


@pytest.mark.django_db
def test_the_31st_failure_in_a_minute_is_throttled_even_with_a_valid_token(agent: Any) -> None:
    fresh_window()
    token = str(TokenFactory.create(user=agent).key)
    guesser = api_client("not-a-real-token", address="10.0.0.66")
    for _ in range(30):
        assert guesser.get("/api/v1/tasks/").status_code == 401

    assert_throttled(guesser.get("/api/v1/tasks/"))
    # Also the right token, from that address: the status must not tell a right guess.
    assert_throttled(api_client(token, address="10.0.0.66").get("/api/v1/tasks/"))
    assert_throttled(api_client(None, address="10.0.0.66").get("/api/v1/events/"))
    # Another address is not concerned.
    assert api_client(token, address="10.0.0.7").get("/api/v1/tasks/").status_code == 200
    assert AuthFailure.objects.get(address="10.0.0.66").failures == 30
    # A host this server does not serve is refused as such first, as everywhere.
    foreign = APIClient(REMOTE_ADDR="10.0.0.66", HTTP_HOST="evil.example")
    assert foreign.get("/api/v1/tasks/").status_code == 400


@pytest.mark.django_db
def test_a_client_that_only_authenticates_successfully_is_never_throttled(agent: Any) -> None:
    client = api_client(str(TokenFactory.create(user=agent).key), address="10.0.0.8")

    statuses = {client.get("/api/v1/tasks/").status_code for _ in range(100)}

    assert statuses == {200}
    assert not AuthFailure.objects.exists()


@pytest.mark.django_db
def test_a_session_is_throttled_too(agent: Any, settings: Any) -> None:
    settings.TASKBOARD_AUTH_FAILURE_LIMIT = 3
    fresh_window()
    browser = Client(REMOTE_ADDR="10.0.0.9")
    for _ in range(3):
        assert browser.get("/api/v1/tasks/", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    browser.force_login(agent)

    assert_throttled(browser.get("/api/v1/tasks/"))


@pytest.mark.django_db
def test_failures_across_a_window_boundary_are_held_to_the_limit(settings: Any) -> None:
    """Counts are kept per fixed window, but the limit holds over any span of a window's
    length: failures just before a boundary still count just after it (a fixed window
    alone let 25 + 30 through here)."""
    settings.TASKBOARD_AUTH_FAILURE_WINDOW_SECONDS = 4
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM statement_timestamp())::float8")
        left = 4 - cursor.fetchone()[0] % 4
    time.sleep(left - 0.4 if left > 0.4 else left + 3.6)  # 0.4 s before a boundary
    guesser = api_client("wrong", address="10.0.0.99")
    let_through = 0
    for _ in range(25):
        let_through += guesser.get("/api/v1/tasks/").status_code == 401
    time.sleep(0.45)  # into the next window
    while guesser.get("/api/v1/tasks/").status_code == 401:
        let_through += 1
        assert let_through < 60

    assert 30 <= let_through <= 34


@pytest.mark.django_db
def test_the_throttle_ends_with_its_window(agent: Any, settings: Any) -> None:
    settings.TASKBOARD_AUTH_FAILURE_LIMIT = 3
    settings.TASKBOARD_AUTH_FAILURE_WINDOW_SECONDS = 2
    token = str(TokenFactory.create(user=agent).key)
    fresh_window(1.5)
    for _ in range(3):
        assert api_client("wrong").get("/api/v1/tasks/").status_code == 401
    throttled = api_client(token).get("/api/v1/tasks/")
    assert throttled.status_code == 429
    assert int(throttled["Retry-After"]) <= 2

    time.sleep(int(throttled["Retry-After"]) + 0.1)

    assert api_client(token).get("/api/v1/tasks/").status_code == 200


@pytest.mark.django_db
def test_the_schema_and_docs_need_no_authentication_and_are_not_throttled(
    settings: Any,
) -> None:
    settings.TASKBOARD_AUTH_FAILURE_LIMIT = 1
    fresh_window()
    assert api_client("wrong").get("/api/v1/tasks/").status_code == 401
    assert api_client("wrong").get("/api/v1/tasks/").status_code == 429

    assert api_client().get("/api/v1/schema/").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("login_url", ["/admin/login/", "/accounts/login/"])
def test_the_31st_failed_login_in_a_minute_is_throttled(login_url: str) -> None:
    fresh_window()
    get_user_model().objects.create_superuser("root", password="right-password")
    browser = Client(REMOTE_ADDR="10.0.0.10")
    for _ in range(30):
        response = browser.post(login_url, {"username": "root", "password": "wrong"})
        assert response.status_code == 200  # the form again, with its error

    for password in ("wrong", "right-password"):
        refused = browser.post(login_url, {"username": "root", "password": password})
        assert refused.status_code == 429
        assert "Try again in" in refused.content.decode()
        assert 1 <= int(refused["Retry-After"]) <= 60
        assert "_auth_user_id" not in browser.session
    # The form itself still shows; another address still logs in.
    assert browser.get(login_url).status_code == 200
    other = Client(REMOTE_ADDR="10.0.0.11")
    response = other.post(login_url, {"username": "root", "password": "right-password"})
    assert response.status_code == 302


@pytest.mark.django_db
@pytest.mark.parametrize("change_url", ["/admin/password_change/", "/accounts/password_change/"])
def test_guessing_the_current_password_in_a_password_change_is_throttled(
    change_url: str,
) -> None:
    """A stolen session must not become a password oracle: each wrong current password
    counts as a failed authentication, and the 31st try is refused."""
    fresh_window()
    user = get_user_model().objects.create_superuser("root", password="right-password")
    browser = Client(REMOTE_ADDR="10.0.0.12")
    browser.force_login(user)
    guess = {"new_password1": "a-New-pass-42", "new_password2": "a-New-pass-42"}
    for _ in range(30):
        response = browser.post(change_url, {"old_password": "wrong", **guess})
        assert response.status_code == 200  # the form again, with its error

    refused = browser.post(change_url, {"old_password": "right-password", **guess})

    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    user.refresh_from_db()
    assert user.check_password("right-password")
    assert AuthFailure.objects.get(address="10.0.0.12").failures == 30


# Across server processes, and on the stream (live servers, committed rows)


@pytest.fixture
def two_servers() -> Iterator[tuple[LiveServer, LiveServer]]:
    with live_server() as first, live_server() as second:
        yield first, second


@pytest.mark.django_db(transaction=True)
def test_failures_through_two_servers_add_up(
    two_servers: tuple[LiveServer, LiveServer], agent: Any
) -> None:
    token = str(TokenFactory.create(user=agent).key)
    fresh_window()
    bad = {"Authorization": "Bearer wrong"}
    for n in range(30):
        server = two_servers[n % 2]
        assert httpx.get(f"{server.url}/api/v1/tasks/", headers=bad).status_code == 401

    for server in two_servers:
        response = httpx.get(
            f"{server.url}/api/v1/tasks/", headers={"Authorization": f"Bearer {token}"}
        )
        assert response.status_code == 429, response.text
        assert response.json()["error"] == "throttled"
        assert 1 <= int(response.headers["Retry-After"]) <= 60


@pytest.mark.django_db(transaction=True)
def test_the_stream_counts_failures_and_is_throttled(server: LiveServer, agent: Any) -> None:
    token = str(TokenFactory.create(user=agent).key)
    fresh_window()
    url = f"{server.url}/api/v1/stream/"
    for n in range(30):
        headers = {"Authorization": "Bearer wrong" if n % 2 else "Token wrong"}
        assert httpx.get(url, headers=headers).status_code == 401

    refused = httpx.get(url, headers={"Authorization": f"Bearer {token}"})

    assert refused.status_code == 429
    assert refused.json()["error"] == "throttled"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    # The API shares the count: it is one throttle.
    tasks = httpx.get(f"{server.url}/api/v1/tasks/", headers={"Authorization": f"Bearer {token}"})
    assert tasks.status_code == 429


@pytest.mark.django_db(transaction=True)
def test_requests_without_credentials_count_nothing(server: LiveServer, agent: Any) -> None:
    """A board left open after its user logged out asks for the stream and the panels
    again and again, with a session that ended and no token: that guesses nothing, and
    must not lock out the agents behind the same address."""
    token = str(TokenFactory.create(user=agent).key)
    logged_out = httpx.Client(base_url=server.url, cookies={"sessionid": "ended" * 6})
    fresh_window()
    for path in (
        "/api/v1/stream/",
        "/api/v1/queues/",
        "/api/v1/agents/",
        "/panels/",
        "/metrics",
    ) * 10:
        assert logged_out.get(path).status_code == 401
        assert httpx.get(f"{server.url}{path}").status_code == 401

    tasks = httpx.get(f"{server.url}/api/v1/tasks/", headers={"Authorization": f"Bearer {token}"})

    assert tasks.status_code == 200, tasks.text
    assert not AuthFailure.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_stream_lets_a_valid_token_in_and_counts_nothing(
    server: LiveServer, agent: Any
) -> None:
    token = str(TokenFactory.create(user=agent).key)
    url = f"{server.url}/api/v1/stream/"
    for _ in range(35):
        with httpx.stream("GET", url, headers={"Authorization": f"Token {token}"}) as response:
            assert response.status_code == 200

    assert not AuthFailure.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_python_client_raises_throttled_with_the_wait(
    server: LiveServer, agent: Any, settings: Any
) -> None:
    from taskboard_agent.client import AuthenticationError, Client, Throttled

    settings.TASKBOARD_AUTH_FAILURE_LIMIT = 1
    token = str(TokenFactory.create(user=agent).key)
    fresh_window()
    with Client(server.url, "wrong", retries=0) as stranger, pytest.raises(AuthenticationError):
        stranger.list_tasks()
    with Client(server.url, token, retries=0) as board:
        with pytest.raises(Throttled) as refused:
            board.claim()
        with pytest.raises(Throttled):
            next(board.stream())

    assert refused.value.status == 429 and refused.value.code == "throttled"
    assert refused.value.retry_after is not None and 1 <= refused.value.retry_after <= 60


@pytest.fixture
def serve_process(tmp_path: Any) -> Iterator[str]:
    """``taskboard serve`` in a process of its own, on the test database; yield its URL."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from urllib.parse import quote

    from tests.live import free_port

    params = connection.get_connection_params()
    host = quote(str(params.get("host") or "127.0.0.1"), safe="")
    url = f"postgresql://{params['user']}@{host}:{params.get('port', 5432)}/{params['dbname']}"
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url, "TASKBOARD_DATA_DIR": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--no-migrate", "--port", str(port)],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the server process exited"
            assert time.monotonic() < deadline, "the server process did not start"
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.once
@pytest.mark.django_db(transaction=True)
def test_failures_through_two_server_processes_add_up(
    server: LiveServer, serve_process: str, agent: Any
) -> None:
    token = str(TokenFactory.create(user=agent).key)
    fresh_window()
    bad = {"Authorization": "Bearer wrong"}
    for n in range(30):
        url = server.url if n % 2 else serve_process
        assert httpx.get(f"{url}/api/v1/tasks/", headers=bad).status_code == 401

    # Either process alone has seen 15: the limit holds because the count is shared.
    for url in (server.url, serve_process):
        response = httpx.get(f"{url}/api/v1/tasks/", headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 429, response.text
        assert 1 <= int(response.headers["Retry-After"]) <= 60


class FailureReads:
    """Counts the throttle's reads of an address's failures (access.throttle)."""

    def __init__(self, monkeypatch: Any) -> None:
        from access import throttle

        self.count = 0
        counter = self

        class Counting(dict):  # type: ignore[type-arg]
            def __getitem__(self, name: str) -> str:
                if name == "failures":
                    counter.count += 1
                return str(super().__getitem__(name))

        monkeypatch.setattr(throttle, "QUERIES", Counting(throttle.QUERIES))


def another_process_records_failures(address: str, count: int) -> None:
    """What record_failure does in another server process: its statement, which announces
    the first failure of a window (this process's memory is not touched)."""
    from access import throttle

    with connection.cursor() as cursor:
        for _ in range(count):
            cursor.execute(
                throttle.QUERIES["record_failure"],
                {"address": address, "window": throttle.window()},
            )


def listening_relay(server: LiveServer) -> Any:
    """The live server's relay, once it listens (the throttle remembers nothing before)."""
    from board.live import relay as relay_module

    deadline = time.monotonic() + 10
    while True:
        relays = [r for loop, r in relay_module._relays.items() if not loop.is_closed()]
        if relays and relays[0].connected.is_set():
            return relays[0]
        assert time.monotonic() < deadline, "the server's relay did not start"
        time.sleep(0.02)


@pytest.mark.django_db(transaction=True)
def test_an_address_without_failures_is_read_once_not_on_every_call(
    server: LiveServer, agent: Any, monkeypatch: Any
) -> None:
    listening_relay(server)
    reads = FailureReads(monkeypatch)
    headers = {"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"}
    with httpx.Client(base_url=server.url, headers=headers) as client:
        statuses = [client.get("/api/v1/tasks/").status_code for _ in range(20)]

    assert statuses == [200] * 20
    assert reads.count == 1


@pytest.mark.django_db(transaction=True)
def test_failures_counted_by_another_process_throttle_an_address_read_as_clean(
    server: LiveServer, agent: Any, settings: Any, monkeypatch: Any
) -> None:
    """The memory of clean addresses is per process; another process's first failure of
    a window is announced to every process (NOTIFY auth_failures), which forgets it."""
    settings.TASKBOARD_AUTH_FAILURE_LIMIT = 3
    fresh_window()
    listening_relay(server)
    reads = FailureReads(monkeypatch)
    headers = {"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"}
    with httpx.Client(base_url=server.url, headers=headers) as client:
        assert client.get("/api/v1/tasks/").status_code == 200
        assert client.get("/api/v1/tasks/").status_code == 200
        assert reads.count == 1, "not remembered"

        another_process_records_failures("127.0.0.1", 3)

        deadline = time.monotonic() + 5
        while (status := client.get("/api/v1/tasks/").status_code) == 200:
            assert time.monotonic() < deadline, "still let in after the limit"
            time.sleep(0.05)
    assert status == 429


@pytest.mark.django_db(transaction=True)
def test_failures_announced_while_the_relay_was_cut_off_still_throttle(
    server: LiveServer, agent: Any, settings: Any, monkeypatch: Any
) -> None:
    """An announcement made while the process's relay is reconnecting is lost: the relay
    forgets every address when it listens again."""
    settings.TASKBOARD_AUTH_FAILURE_LIMIT = 3
    fresh_window()
    relay = listening_relay(server)
    reads = FailureReads(monkeypatch)
    headers = {"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"}
    with httpx.Client(base_url=server.url, headers=headers) as client:
        assert client.get("/api/v1/tasks/").status_code == 200
        assert client.get("/api/v1/tasks/").status_code == 200
        assert reads.count == 1, "not remembered"

        with relay_cut_off(relay):
            another_process_records_failures("127.0.0.1", 3)

        assert client.get("/api/v1/tasks/").status_code == 429
