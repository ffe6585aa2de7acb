"""``manage.py serve``: migrate, then serve the board with uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import sys
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from access import tokens
from board import conf
from taskboard import pushpin, server
from taskboard.embedded import serving


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 1 to 65535, not {text!r}")
    return int(text)


def _at_least_one(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a number of processes, 1 or more, not {text!r}")
    return int(text)


def _from_environment(setting: conf.Setting[Any], parse: Callable[[str], int]) -> int | None:
    """The value of ``setting``'s environment variable (unset or empty: None), parsed as the
    option's own value is, or a clear error naming it."""
    text = setting.raw()
    if not text:
        return None
    try:
        return parse(text)
    except argparse.ArgumentTypeError as exc:
        print(f"taskboard serve: {setting.env} {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def uses_embedded_database() -> bool:
    return bool(settings.DATABASES["default"]["ENGINE"] == "taskboard.embedded")


class Command(BaseCommand):
    help = "Apply migrations, then serve the board, the API and the admin (ASGI, uvicorn)."

    def add_arguments(self, parser: CommandParser) -> None:
        # Empty variables count as unset, as WEB_CONCURRENCY below and settings' env_int.
        parser.add_argument("--host", default=conf.host())
        parser.add_argument(
            "--port", type=_port, default=_from_environment(conf.port, _port) or conf.port.default
        )
        parser.add_argument(
            "--workers",
            type=_at_least_one,
            default=_from_environment(conf.web_concurrency, _at_least_one) or usable_cpus(),
            help="server processes (each with its own event relay); default: WEB_CONCURRENCY, "
            f"or the CPUs this process may use ({usable_cpus()} here)",
        )
        parser.add_argument("--no-migrate", action="store_true", help="skip migrations")
        parser.add_argument(
            "--pushpin",
            action="store_true",
            help="put Pushpin (Debian's pushpin package) on --port, in front of the server "
            "processes, which then listen on 127.0.0.1:--origin-port",
        )
        parser.add_argument(
            "--origin-port",
            type=int,
            default=0,
            help="with --pushpin: the private port of the server processes (default: a free one)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # The port first: a busy one is said in one line before anything is migrated,
        # started or announced.
        listener = self.bind(options["host"], options["port"])
        # Server commands run from another directory find this database while it serves.
        served = (
            serving.registered(conf.data_dir())
            if uses_embedded_database()
            else contextlib.nullcontext()
        )
        try:
            with served:
                self.serve(listener, options)
        finally:
            listener.close()

    @staticmethod
    def bind(host: str, port: int) -> socket.socket:
        try:
            return server.bind(host, port)
        except server.PortTaken as exc:
            raise CommandError(str(exc)) from None

    def serve(self, listener: socket.socket, options: dict[str, Any]) -> None:
        if not options["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        if uses_embedded_database():
            self.first_run_accounts()
        base = f"http://{_display_host(options['host'])}:{options['port']}"
        host, port = options["host"], options["port"]
        edge: pushpin.Pushpin | None = None
        if options["pushpin"]:
            # Pushpin listens on the port itself: this process lets go of it just before,
            # and serves on the origin port instead.
            listener.close()
            host, port = "127.0.0.1", options["origin_port"] or free_port()
            listener = self.bind(host, port)
            try:
                origin = f"{host}:{port}"
                directory = conf.data_dir() / "pushpin"
                edge = pushpin.Pushpin(
                    directory,
                    http_port=options["port"],
                    origin=origin,
                    proxies_in_front=bool(conf.forwarded_allow_ips()),
                )
                edge.start().wait_ready()
                # Streams are held in Pushpin, and events published to it (board.live.grip):
                # in this process, and in the workers started from it.
                os.environ["GRIP_URL"] = settings.GRIP_URL = edge.grip_url
            except pushpin.PushpinUnavailable as exc:
                raise CommandError(str(exc)) from exc
        self.stdout.write(
            "\n".join(
                [
                    "",
                    f"  Board       {base}/",
                    f"  Admin       {base}/admin/",
                    f"  API docs    {base}/api/v1/docs/",
                    f"  Health      {base}/healthz",
                    f"  Database    {database_description()}",
                    *(
                        [f"  Pushpin     port {options['port']}, to the server on {host}:{port}"]
                        if edge
                        else []
                    ),
                    "",
                ]
            )
        )
        self.stdout.flush()
        proxies = trusted_proxies(pushpin=edge is not None)
        config = server.Config(
            "taskboard.asgi:application",
            host=host,
            port=port,
            workers=options["workers"],
            lifespan="on",
            # Requests in progress get this long on shutdown (streams end at once).
            timeout_graceful_shutdown=5,
            # With --workers: how long a process may not answer before it is replaced.
            timeout_worker_healthcheck=conf.worker_timeout(),
            log_level=conf.log_level().lower(),
            proxy_headers=bool(proxies),
            forwarded_allow_ips=proxies,
            server_header=False,
            http=server.HttpToolsProtocol,
            header_timeout=conf.header_timeout(),
            headers=server.BEHIND_PUSHPIN_HEADERS if conf.grip_url() else None,
        )
        try:
            server.run(config, listener)
        finally:
            if edge is not None:
                edge.stop()

    def first_run_accounts(self) -> None:
        """On a new embedded database, create ``admin`` and ``demo-agent`` and print their
        secrets, once: later runs find the users and print nothing."""
        User = get_user_model()
        with transaction.atomic():
            if User.objects.filter(username="admin").exists():
                return
            password = secrets.token_urlsafe(12)
            User.objects.create_superuser("admin", email="", password=password)
            agent, _ = User.objects.get_or_create(username="demo-agent")
            agent.set_unusable_password()
            agent.save()
            token = tokens.issue(agent)
        self.stdout.write(
            self.style.SUCCESS("First run: created accounts (shown once, keep them):")
        )
        self.stdout.write(f"  admin       password {password}")
        self.stdout.write(f"  demo-agent  token    {token.key}")


def trusted_proxies(*, pushpin: bool) -> list[str]:
    """Return the peers whose X-Forwarded-For and X-Forwarded-Proto uvicorn believes:
    FORWARDED_ALLOW_IPS, and behind ``--pushpin`` the loopback address that its own
    Pushpin connects from (the server processes then listen on 127.0.0.1 only)."""
    proxies = list(conf.forwarded_allow_ips())
    if pushpin and "127.0.0.1" not in proxies:
        proxies.append("127.0.0.1")
    return proxies


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's limit),
    where the system says; else all of the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _display_host(host: str) -> str:
    if host in {"0.0.0.0", "::", ""}:
        return "localhost"
    return f"[{host}]" if ":" in host else host


def database_description() -> str:
    db = settings.DATABASES["default"]
    if uses_embedded_database():
        return f"embedded PostgreSQL in {conf.data_dir() / 'pgdata'}"
    return f"{db.get('HOST') or 'local socket'}:{db.get('PORT') or 5432}/{db['NAME']}"
