"""Every setting of the board, declared once: its environment variable, type, default,
range and meaning.

``taskboard/settings.py`` builds Django's settings from these declarations
(``Setting.from_environment``: a value out of range stops the process with one line that
names the variable), and the rest of the server reads each setting here, by calling it:
``conf.lease_seconds()`` reads ``settings.TASKBOARD_LEASE_SECONDS`` at the time of the
call, so that a test's ``settings`` fixture or ``override_settings`` reaches every reader.
``taskboard configuration`` prints the declarations as the table of the settings page of
the documentation (``markdown_table``); ``tests/test_conf.py`` checks that no other module
reads a declared variable from Django's settings or the environment by itself.

A few settings are only the environment's (``environment_only``): the database's connection
options, which Django keeps inside ``DATABASES``, and the defaults of ``serve``'s options.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Iterator
from email.utils import parseaddr
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, cast

import psycopg
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from psycopg.conninfo import conninfo_to_dict

T = TypeVar("T")

# The API's bounds: fixed, not settings (the contract states them).
MAX_LEASE_SECONDS = 86400
MAX_WAIT_SECONDS = 60
MAX_CLAIM_LIMIT = 100
MAX_BODY_BYTES = 1024 * 1024

# Every declared setting, in the order of the documentation's table.
DECLARED: list[Setting[Any]] = []


class Setting(Generic[T]):
    """One setting: the environment variable ``env`` sets the Django setting
    ``attribute`` (the same name unless given); ``environment_only``: Django keeps none."""

    kind: ClassVar[str]
    # Whether a variable set to the empty text counts as unset (as a number's does).
    empty_is_unset = True

    def __init__(
        self,
        env: str,
        default: T,
        *,
        description: str,
        attribute: str | None = None,
        environment_only: bool = False,
        minimum: int | None = None,
        maximum: int | None = None,
        choices: tuple[str, ...] = (),
        check: Callable[[str, T], None] | None = None,
        default_text: str | None = None,
        empty_is_unset: bool | None = None,
    ) -> None:
        self.env = env
        self.default = default
        self.description = description
        self.attribute = None if environment_only else attribute or env
        self.minimum = minimum
        self.maximum = maximum
        self.choices = choices
        self.check = check
        self.default_text = default_text
        if empty_is_unset is not None:
            self.empty_is_unset = empty_is_unset
        DECLARED.append(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.env}>"

    def __call__(self) -> T:
        """Return the value in force: Django's setting, read now (the environment's, for
        a setting Django does not keep)."""
        if self.attribute is None:
            return self.from_environment()
        return self.coerce(getattr(settings, self.attribute, self.default))

    def raw(self) -> str | None:
        """Return the variable's text, or None when it is unset."""
        text = os.environ.get(self.env)
        if text is None or (text == "" and self.empty_is_unset):
            return None
        return text

    def from_environment(self) -> T:
        """Return the value the environment gives, or the default; ImproperlyConfigured
        naming the variable when it cannot be one."""
        text = self.raw()
        value = self.default if text is None else self.parse(text)
        if self.check is not None:
            self.check(self.env, value)
        return value

    def parse(self, text: str) -> T:
        raise NotImplementedError

    def coerce(self, value: Any) -> T:
        return cast(T, value)

    def refuse(self, what: str, text: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(f"{self.env} must be {what}, not {text!r}")

    # What the documentation's table shows.

    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.default is None or self.default == "":
            return "unset"
        return f"`{self.show(self.default)}`"

    def show(self, value: T) -> str:
        return str(value)

    def shown_range(self) -> str:
        return ""


class _Number(Setting[T]):
    """A whole number in the environment, within ``minimum`` and ``maximum``."""

    kind = "integer"

    def integer(self, text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise self.refuse("an integer", text) from None
        if not self.within(number):
            raise self.refuse(self.bounds(), text)
        return number

    def within(self, number: int) -> bool:
        return (self.minimum is None or number >= self.minimum) and (
            self.maximum is None or number <= self.maximum
        )

    def bounds(self) -> str:
        if self.maximum is not None:
            return f"from {self.minimum} to {self.maximum}"
        return f"{self.minimum} or more"

    def shown_range(self) -> str:
        if self.minimum is None and self.maximum is None:
            return ""
        if self.maximum is None:
            return f"{self.minimum} or more"
        return f"{self.minimum}..{self.maximum}"


class Integer(_Number[int]):
    def parse(self, text: str) -> int:
        return self.integer(text)

    def coerce(self, value: Any) -> int:
        return int(value)


class Seconds(_Number[float]):
    """A whole number of seconds in the environment; a test may set a fraction."""

    kind = "seconds"

    def parse(self, text: str) -> float:
        return self.integer(text)

    def coerce(self, value: Any) -> float:
        return float(value)


class OptionalInteger(_Number["int | None"]):
    """An integer, or None when unset or 0."""

    def parse(self, text: str) -> int | None:
        try:
            number = int(text)
        except ValueError:
            raise self.refuse("an integer", text) from None
        if number == 0:
            return None
        if not self.within(number):
            raise self.refuse(f"{self.bounds()}, or unset", text)
        return number

    def coerce(self, value: Any) -> int | None:
        return int(value) if value else None


class Flag(Setting[bool]):
    kind = "boolean"

    def parse(self, text: str) -> bool:
        if text.lower() in {"1", "true", "yes", "on"}:
            return True
        if text.lower() in {"0", "false", "no", "off"}:
            return False
        raise ImproperlyConfigured(f"{self.env} must be a boolean (1/0, true/false), not {text!r}")

    def coerce(self, value: Any) -> bool:
        return bool(value)

    def show(self, value: bool) -> str:
        return str(value).lower()


class Text(Setting[str]):
    kind = "text"

    def parse(self, text: str) -> str:
        return text

    def coerce(self, value: Any) -> str:
        return "" if value is None else str(value)


class Choice(Text):
    """One of ``choices``, in any case (the value is upper case)."""

    kind = "choice"

    def parse(self, text: str) -> str:
        if text.upper() not in self.choices:
            *most, last = (choice.lower() for choice in self.choices)
            raise self.refuse(f"{', '.join(most)} or {last}", text)
        return text.upper()

    def shown_range(self) -> str:
        return ", ".join(choice.lower() for choice in self.choices) + " (any case)"


class Texts(Setting[list[str]]):
    """Comma-separated; set to the empty text, none (not the default)."""

    kind = "list"
    empty_is_unset = False

    def parse(self, text: str) -> list[str]:
        return [item.strip() for item in text.split(",") if item.strip()]

    def from_environment(self) -> list[str]:
        return list(super().from_environment())

    def coerce(self, value: Any) -> list[str]:
        return list(value)

    def shown_default(self) -> str:
        if self.default_text is None and not self.default:
            return "empty"
        return super().shown_default()

    def show(self, value: list[str]) -> str:
        return ",".join(value)


class Directory(Setting[Path]):
    kind = "path"

    def parse(self, text: str) -> Path:
        return Path(text).resolve()

    def coerce(self, value: Any) -> Path:
        return Path(value)


def _connection_url(name: str, value: str) -> None:
    if value:
        try:
            conninfo_to_dict(value)
        except psycopg.ProgrammingError as exc:
            raise ImproperlyConfigured(
                f"{name} is not a URL it can use: {str(exc).strip()}"
            ) from None


def _http_url(name: str, value: str) -> None:
    if value and not value.lower().startswith(("http://", "https://")):
        raise ImproperlyConfigured(f"{name} must be an http or https URL, not {value!r}")


def _proxies(name: str, value: list[str]) -> None:
    for proxy in value:
        try:
            if proxy != "*":
                ipaddress.ip_network(proxy)
        except ValueError:
            raise ImproperlyConfigured(
                f"{name} must be IP addresses or networks, comma-separated (or *), not {proxy!r}"
            ) from None


def _mailboxes(name: str, value: list[str]) -> None:
    for address in value:
        # As an email's To: takes them: "Ops <ops@example.com>", or a host without a dot
        # (ops@intranet); only text that names no mailbox at all is refused.
        mailbox = parseaddr(address)[1]
        if not re.fullmatch(r"[^@\s]+@[^@\s]+", mailbox):
            raise ImproperlyConfigured(
                f"{name} must be email addresses, comma-separated: not {address!r}"
            )


database_url: Text = Text(
    "DATABASE_URL",
    "",
    environment_only=True,
    default_text="unset: embedded",
    description=(
        "`postgresql://user:password@host:port/dbname`. When set it always wins; PostgreSQL "
        "14 or newer. Unset: an embedded PostgreSQL under `TASKBOARD_DATA_DIR`, started on "
        "first use and shared by every process on that directory."
    ),
)
data_dir: Directory = Directory(
    "TASKBOARD_DATA_DIR",
    Path(".taskboard"),
    attribute="DATA_DIR",
    default_text="`./.taskboard`",
    description=(
        "the embedded database (`pgdata/`), the generated secret key, collected static files"
    ),
)
secret_key: Text = Text(
    "SECRET_KEY",
    "",
    attribute="SECRET_KEY",
    default_text="generated",
    description=(
        "Django's secret key; unset, a random one is kept in `TASKBOARD_DATA_DIR/secret_key`."
        " Set it when several hosts serve the board."
    ),
)
debug: Flag = Flag(
    "DEBUG",
    False,
    description=("Django's debug mode; never in production"),
)
allowed_hosts: Texts = Texts(
    "ALLOWED_HOSTS",
    ["localhost", "127.0.0.1", "[::1]"],
    description=("comma-separated host names the server answers to"),
)
csrf_trusted_origins: Texts = Texts(
    "CSRF_TRUSTED_ORIGINS",
    [],
    description=(
        "comma-separated origins (`https://board.example.com`) for browser POSTs behind a proxy"
    ),
)
https: Flag = Flag(
    "TASKBOARD_HTTPS",
    False,
    description=(
        "`true` when browsers reach the board over HTTPS only (normally through a proxy that "
        "terminates TLS): `Secure` session and CSRF cookies, HSTS, `X-Forwarded-Proto: https`"
        " from a proxy named in `FORWARDED_ALLOW_IPS` taken as TLS, and a "
        "Content-Security-Policy (scripts from the server's own files only). See [Deploy with"
        " TLS and N processes](../how-to/deploy.md)."
    ),
)
hsts_seconds: Integer = Integer(
    "TASKBOARD_HSTS_SECONDS",
    365 * 24 * 3600,
    minimum=0,
    attribute="SECURE_HSTS_SECONDS",
    description=(
        "with `TASKBOARD_HTTPS`: how long browsers keep to HTTPS for this host (HSTS "
        "`max-age`; 0 sends none)"
    ),
)
lease_seconds: Integer = Integer(
    "TASKBOARD_LEASE_SECONDS",
    120,
    minimum=1,
    maximum=MAX_LEASE_SECONDS,
    description=("the lease a claim gets when it does not ask for one"),
)
max_failures: Integer = Integer(
    "TASKBOARD_MAX_FAILURES",
    3,
    minimum=1,
    maximum=100,
    description=("strikes before escalation, for a task created without `max_failures`"),
)
answer_within: Integer = Integer(
    "TASKBOARD_ANSWER_WITHIN",
    86400,
    minimum=60,
    maximum=2592000,
    description=(
        "how long a person has to answer an agent's question asked without `answer_within` "
        "(seconds); the task is escalated when nobody answered by then"
    ),
)
answer_hold_seconds: Integer = Integer(
    "TASKBOARD_ANSWER_HOLD_SECONDS",
    300,
    minimum=0,
    maximum=86400,
    description=(
        "how long after the answer only the agent that asked may claim the task (0: anyone at once)"
    ),
)
max_attempt_seconds: OptionalInteger = OptionalInteger(
    "TASKBOARD_MAX_ATTEMPT_SECONDS",
    None,
    minimum=1,
    maximum=604800,
    description=(
        "how long one attempt may hold a task created without `max_attempt_seconds`, however "
        "often it heartbeats (1..604800; unset or 0: no limit). A create that sends "
        '`"max_attempt_seconds": null` asks for no limit.'
    ),
)
database_conn_max_age: Integer = Integer(
    "DATABASE_CONN_MAX_AGE",
    300,
    minimum=0,
    environment_only=True,
    description=("seconds a server thread keeps its database connection (0: one per request)"),
)
threads: Integer = Integer(
    "TASKBOARD_THREADS",
    4,
    minimum=1,
    description=(
        "worker threads per server process for pages and API calls; each keeps one database "
        "connection. Open streams and waiting claims use no thread and no connection."
    ),
)
body_timeout: Seconds = Seconds(
    "TASKBOARD_BODY_TIMEOUT",
    30,
    minimum=1,
    description=(
        "seconds a request body may take to arrive in full; a slower one is answered `408 "
        "request_timeout` and its connection closed. Bodies are read before a request takes a"
        " worker thread, so slow clients hold no thread and no database connection."
    ),
)
header_timeout: Integer = Integer(
    "TASKBOARD_HEADER_TIMEOUT",
    10,
    minimum=1,
    maximum=3600,
    description=(
        "seconds a connection has to send a request's complete headers (from when it opens; "
        "for a later request on it, from that request's first byte); a connection that has "
        "not is closed, with `408 request_timeout` when it had begun a request. A response "
        "under way (a stream) is never cut by it"
    ),
)
database_prepared_statements: Flag = Flag(
    "DATABASE_PREPARED_STATEMENTS",
    True,
    default_text="`true`, or `false` when `DATABASE_LISTEN_URL` is set",
    description=(
        "prepare `board/transitions.py`'s statements on each database session, so that "
        "PostgreSQL plans each once per session instead of at every call (planning the claim "
        "took longer than running it: see [decision "
        "0010](../decisions/0010-prepared-transitions.md)). Keep it off behind a pooler in "
        "transaction mode, which lends each transaction another server connection: PgBouncer "
        "1.18 (Debian 12's) keeps no prepared statement, and even a PgBouncer that tracks "
        "them (1.22 and later, `max_prepared_statements`) shares one per statement text, "
        "which the retry after a migration (below) cannot renew. Direct to PostgreSQL, after "
        "a migration changes a table under a prepared statement, the next call outside a "
        "transaction prepares it afresh, and one inside a transaction fails once on each kept"
        " connection"
    ),
)
database_listen_url: Text = Text(
    "DATABASE_LISTEN_URL",
    "",
    check=_connection_url,
    description=(
        "the same database reached directly (`postgresql://...`), for each server process's "
        "relay (its `LISTEN`, and replays of old events), when `DATABASE_URL` goes through a "
        "pooler in transaction mode such as PgBouncer, which cannot carry a `LISTEN`; also "
        "turns off server-side cursors. Unset: the relay uses `DATABASE_URL`"
    ),
)
grip_url: Text = Text(
    "GRIP_URL",
    "",
    check=_http_url,
    default_text="unset (set by `serve --pushpin`)",
    description=(
        "Pushpin's publish endpoint and the key it signs requests with, in django-grip's "
        "format (`http://127.0.0.1:5561?verify-iss=pushpin&verify-key=base64:...`): streams "
        "are then held in Pushpin and their events published to it by one server process at a"
        " time (see [Put Pushpin in front](../how-to/pushpin.md)). Set it when you run "
        "Pushpin yourself with `deploy/pushpin/`'s configuration"
    ),
)
stream_buffer_bytes: Integer = Integer(
    "TASKBOARD_STREAM_BUFFER_BYTES",
    64 * 2**20,
    minimum=2**20,
    maximum=2**40,
    default_text="`67108864` (64 MiB)",
    description=(
        "how much memory each server process keeps of the latest events (at most 10,000 of "
        "them), from which a stream that reconnects is replayed; an older gap is read from "
        "`task_events` (at least 1 MiB)"
    ),
)
held_stream_recheck_seconds: Seconds = Seconds(
    "TASKBOARD_HELD_STREAM_RECHECK_SECONDS",
    600,
    minimum=1,
    description=(
        "behind Pushpin, how often each held stream's credentials and queue limit are checked"
        " again (Pushpin asks the board; streams of one token share one request): the "
        "backstop, since a change of credentials closes the user's held streams at once"
    ),
)
database_connect_timeout: Integer = Integer(
    "DATABASE_CONNECT_TIMEOUT",
    5,
    minimum=1,
    environment_only=True,
    description=(
        "seconds before an unreachable database answers 503; also the relay's "
        "`DATABASE_LISTEN_URL` connection, unless that URL sets `connect_timeout`"
    ),
)
database_health_checks: Flag = Flag(
    "DATABASE_HEALTH_CHECKS",
    True,
    environment_only=True,
    description=(
        "check a kept connection before each request and replace it if PostgreSQL ended it (a"
        " restart, a failover, `pg_terminate_backend`): a poll of its socket, and Django's "
        "`SELECT 1` only when the server sent something (`taskboard/postgresql`); off, the "
        "first request on each such connection answers 503"
    ),
)
health_timeout: Seconds = Seconds(
    "TASKBOARD_HEALTH_TIMEOUT",
    3,
    minimum=1,
    description=(
        "seconds `GET /healthz` waits for the database to answer `SELECT 1` (on a connection "
        "of its own, made as requests make theirs) before it answers 503: a database that "
        "hangs (stopped, or behind a network that drops packets) answers a load balancer's "
        "probe in time. Requests meanwhile share the check under way; one that has hung "
        "longer than this is left to itself and the next request starts another (at most 4 "
        "hang at once per process), so the first probe after the database is back answers 200"
        " (`board/ops/health.py`)"
    ),
)
token_cache_seconds: Seconds = Seconds(
    "TASKBOARD_TOKEN_CACHE_SECONDS",
    10,
    minimum=0,
    description=(
        "how long a server process remembers an API token's lookup (by the token's digest, "
        "with its agent's queue limit); a deleted or rotated token, a deactivated user, a "
        "changed queue limit or a change of what the user may do (staff or superuser status, "
        "a permission or group given or taken) takes effect at most this much later (0: look "
        "up every time), and at once in a process whose event relay runs (it hears the "
        "change: `board/live/revocation.py`). Open streams are re-checked as often (at least "
        "every second), and at once on such a change: a revoked stream ends, a changed limit "
        "applies to it; streams held in Pushpin are closed at once on such a change (their "
        "clients resume, under the new limit or refused), and re-checked every "
        "`TASKBOARD_HELD_STREAM_RECHECK_SECONDS`"
    ),
)
metrics_public: Flag = Flag(
    "TASKBOARD_METRICS_PUBLIC",
    False,
    description=(
        "`true`: `GET /metrics` answers anyone; otherwise only staff (a staff user's API "
        "token or session). See [Metrics](metrics.md)"
    ),
)
mcp_session_idle_seconds: Seconds = Seconds(
    "TASKBOARD_MCP_SESSION_IDLE_SECONDS",
    120,
    minimum=1,
    description=(
        "how long an MCP session over Streamable HTTP (`/mcp/`) may be idle (no request in "
        "flight and no open stream; the SDK's client keeps one open while it runs) before it "
        "ends; its leases are renewed only while its client is there, so a killed client's "
        "tasks return within their lease and 2 s whatever this is"
    ),
)
auth_failure_limit: Integer = Integer(
    "TASKBOARD_AUTH_FAILURE_LIMIT",
    30,
    minimum=0,
    description=(
        "failed authentications (API and stream `401`s, failed logins) one client address may"
        " make within the window below; past them it gets `429` with `Retry-After` (0: no "
        "throttle)"
    ),
)
auth_failure_window_seconds: Integer = Integer(
    "TASKBOARD_AUTH_FAILURE_WINDOW_SECONDS",
    60,
    minimum=1,
    description=("the length of that window, in seconds"),
)
create_rate: Integer = Integer(
    "TASKBOARD_CREATE_RATE",
    6000,
    minimum=0,
    description=(
        "tasks one user may create a minute (REST API and MCP tools alike); past it, `429 "
        "rate_limited` with `Retry-After`, and nothing is created (0: no limit)"
    ),
)
comment_rate: Integer = Integer(
    "TASKBOARD_COMMENT_RATE",
    600,
    minimum=0,
    description=(
        "comments one user may write a minute through the API and MCP tools, likewise (0: no limit)"
    ),
)
host: Text = Text(
    "HOST",
    "127.0.0.1",
    environment_only=True,
    description=("the default of `serve --host`"),
)
port: Integer = Integer(
    "PORT",
    8000,
    minimum=1,
    maximum=65535,
    environment_only=True,
    description=("the default of `serve --port`"),
)
web_concurrency: OptionalInteger = OptionalInteger(
    "WEB_CONCURRENCY",
    None,
    minimum=1,
    environment_only=True,
    default_text="the CPUs `serve` may use",
    description=(
        "the default of `serve --workers`: server processes; unset, one per CPU in the "
        "process's affinity (`os.sched_getaffinity`, else all the machine's)"
    ),
)
worker_timeout: Integer = Integer(
    "TASKBOARD_WORKER_TIMEOUT",
    30,
    minimum=1,
    maximum=86_400,
    description=(
        "seconds a process of `serve --workers N` (N > 1) may leave its supervisor's health "
        "check unanswered before it is killed and replaced (uvicorn's "
        "`timeout_worker_healthcheck`, 5 s by default there). The check is answered by a "
        "thread of its own, so only a process stopped whole (`SIGSTOP`, a debugger) misses "
        "it: what these pages say of a stopped process that is continued holds for pauses "
        "shorter than this (1..86400). A process that dies is replaced at once, also while a "
        "check waits for it"
    ),
)
serve_sockets: Text = Text(
    "TASKBOARD_SERVE_SOCKETS",
    "",
    description=(
        "set by `serve --workers N` (N > 1) for the processes it starts (not to be set by "
        "hand): the private directory where each listens on a Unix socket for the `/mcp/` "
        "requests of its sessions that reach another process"
    ),
)
log_level: Choice = Choice(
    "LOG_LEVEL",
    "INFO",
    choices=("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"),
    description=("logging level of the server and the app (any case: `debug` or `DEBUG`)"),
)
forwarded_allow_ips: Texts = Texts(
    "FORWARDED_ALLOW_IPS",
    [],
    check=_proxies,
    description=(
        "the proxies whose `X-Forwarded-For` and `X-Forwarded-Proto` are believed (the client"
        " address that the failed-authentication throttle counts, and HTTPS behind "
        "`TASKBOARD_HTTPS`): IP addresses or networks, comma-separated "
        "(`10.0.0.5,192.0.2.0/24`); `*` trusts every peer, so only behind a proxy that every "
        "request passes. Empty trusts none: every client is its TCP peer, also on the "
        "server's own host. `serve --pushpin` adds 127.0.0.1, where its own Pushpin connects "
        "from"
    ),
)
prometheus_multiproc_dir: Text = Text(
    "PROMETHEUS_MULTIPROC_DIR",
    "",
    environment_only=True,
    default_text="unset (a fresh temporary directory under `serve --workers N`)",
    description=(
        "where the processes of `serve --workers N` keep the claim histogram that every "
        "scrape adds up (prometheus_client's multiprocess mode): an existing directory, of "
        "one `serve` at a time, emptied of its `*.db` files when `serve` starts. See "
        "[Metrics](metrics.md)"
    ),
)
public_url: Text = Text(
    "TASKBOARD_PUBLIC_URL",
    "http://127.0.0.1:8000",
    empty_is_unset=False,
    description=(
        "the board's address as people reach it: the links to a task's admin page in Slack "
        "messages and emails. The default does not follow `--port`/`PORT`: set it whenever "
        "people reach the board elsewhere"
    ),
)
webhook_timeout_seconds: Seconds = Seconds(
    "TASKBOARD_WEBHOOK_TIMEOUT_SECONDS",
    10,
    minimum=1,
    description=(
        "how long a webhook receiver (or the SMTP server, for the whole session) has to "
        "accept a delivery; a delivery's lease is twice this plus 5 s"
    ),
)
webhook_allow_private: Flag = Flag(
    "TASKBOARD_WEBHOOK_ALLOW_PRIVATE",
    False,
    description=(
        "whether webhooks may reach loopback, private, link-local and other non-public "
        "addresses; off, such a URL is refused when added (`400 invalid`, `url`) and each "
        "delivery is refused before connecting (see [Tell "
        "people](../how-to/notifications.md))"
    ),
)
delivery_backoff_seconds: Integer = Integer(
    "TASKBOARD_DELIVERY_BACKOFF_SECONDS",
    10,
    minimum=1,
    description=(
        "a failed delivery is retried after a random delay of up to this x 2^(attempts-1) seconds"
    ),
)
delivery_max_backoff_seconds: Integer = Integer(
    "TASKBOARD_DELIVERY_MAX_BACKOFF_SECONDS",
    3600,
    minimum=1,
    description=("the most that delay can be"),
)
delivery_horizon_seconds: Integer = Integer(
    "TASKBOARD_DELIVERY_HORIZON_SECONDS",
    24 * 3600,
    minimum=1,
    description=(
        "how long after its event (or a staff retry) a delivery is retried before it is "
        "marked failed"
    ),
)
email_url: Text = Text(
    "EMAIL_URL",
    "",
    description=(
        "`smtp://user:password@host:port/?tls=True` (dj-email-url): email every escalation, "
        "and serve the password reset pages (`/accounts/password_reset/`, linked from the "
        "login page). Unset: no email and no password reset (emails still queued from when it"
        " was set fail, with `not sent: EMAIL_URL was unset`; staff may retry them in the "
        "admin once it is set again). Give every server of one database the same `EMAIL_URL` "
        "and `TASKBOARD_ESCALATION_EMAILS`: any of them may send a given email"
    ),
)
escalation_emails: Texts = Texts(
    "TASKBOARD_ESCALATION_EMAILS",
    [],
    check=_mailboxes,
    default_text=(
        "every active staff user with an email (and not limited to other queues than the task's)"
    ),
    description=("comma-separated addresses the escalation emails go to"),
)
default_from_email: Text = Text(
    "DEFAULT_FROM_EMAIL",
    "taskboard@localhost",
    empty_is_unset=False,
    description=("the emails' sender (also `?_default_from_email=` in `EMAIL_URL`)"),
)
email_timeout: Integer = Integer(
    "EMAIL_TIMEOUT",
    10,
    minimum=1,
    description=(
        "seconds each SMTP read or write may wait, for any email sent through Django "
        "(`?timeout=` in `EMAIL_URL` wins); the deliveries bound the whole session by "
        "`TASKBOARD_WEBHOOK_TIMEOUT_SECONDS`"
    ),
)


def declared() -> Iterator[Setting[Any]]:
    """Yield every setting, in the order of the documentation's table."""
    yield from DECLARED


def markdown_table() -> str:
    """Return the settings as the Markdown table of the documentation's settings page."""
    lines = [
        "| variable | type | default | range | meaning |",
        "|---|---|---|---|---|",
    ]
    for setting in DECLARED:
        cells = (
            f"`{setting.env}`",
            setting.kind,
            setting.shown_default(),
            setting.shown_range(),
            setting.description,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
