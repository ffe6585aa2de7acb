"""The benchmark's and the soak's commands (``taskboard benchmark``, ``taskboard soak``;
``python -m benchmarks [soak]``): Django management commands that the server's
taskboard/management/commands/ finds here when it runs from a checkout
(taskboard.repository)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

import benchmarks
from benchmarks import soak
from benchmarks.harness import ServerParams
from board import conf


class Benchmark(BaseCommand):
    help = (
        "Benchmark the board in scratch databases on the configured PostgreSQL server (the "
        "embedded one by default) against a server started for the purpose: print the "
        "figures beside their targets and write them as JSON."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--quick", action="store_true", help="smaller sizes: finishes in about three minutes"
        )
        parser.add_argument(
            "--only",
            action="append",
            metavar="SCENARIO",
            help="run only these scenarios (repeat or comma-separate): "
            + ", ".join(benchmarks.SCENARIOS),
        )
        parser.add_argument(
            "--output",
            type=Path,
            help="where to write the JSON (default TASKBOARD_DATA_DIR/benchmark/results.json)",
        )
        parser.add_argument(
            "--plot", action="store_true", help="draw PNG charts next to the JSON (matplotlib)"
        )
        parser.add_argument(
            "--database-url",
            help="PostgreSQL server to benchmark on (its scratch databases), instead of the "
            "configured one",
        )
        parser.add_argument(
            "--keep", action="store_true", help="keep the scratch databases afterwards"
        )
        parser.add_argument(
            "--prefix",
            default="taskboard_bench",
            help="name prefix of the scratch databases (default taskboard_bench)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        only = None
        if options["only"]:
            only = [name.strip() for item in options["only"] for name in item.split(",") if name]
        if options["plot"]:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise CommandError(
                    "--plot needs matplotlib: pip install -e '.[bench]' in the checkout"
                ) from None
        if options["database_url"]:
            server = ServerParams.from_url(options["database_url"])
        else:
            server = ServerParams.from_django()
        output = options["output"] or Path(conf.data_dir()) / "benchmark" / "results.json"
        try:
            benchmarks.run(
                quick=options["quick"],
                only=only,
                server=server,
                application_database=settings.DATABASES["default"]["NAME"],
                output=output.resolve(),
                plot=options["plot"],
                keep=options["keep"],
                in_place=not options["database_url"],
                prefix=options["prefix"],
                stdout=self.stdout,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None


class Soak(BaseCommand):
    help = (
        "Run a mixed load (agents, creates, streams that connect and drop, reads, and an "
        "abusive agent) against a "
        "'taskboard serve' started on a scratch database, printing the server's memory, "
        "open files and database connections over time. Fails on a 5xx other than 503."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--minutes", type=float, default=10.0, help="how long to soak (default 10)"
        )
        parser.add_argument(
            "--seconds", type=float, help="how long to soak, in seconds (overrides --minutes)"
        )
        parser.add_argument(
            "--interval", type=float, default=10.0, help="seconds between lines (default 10)"
        )
        parser.add_argument("--agents", type=int, default=8, help="agent threads (default 8)")
        parser.add_argument(
            "--streams", type=int, default=20, help="stream clients at once (default 20)"
        )
        parser.add_argument("--readers", type=int, default=4, help="reader threads (default 4)")
        parser.add_argument(
            "--rate", type=float, default=60.0, help="tasks created per second (default 60)"
        )
        parser.add_argument(
            "--no-abuse",
            action="store_true",
            help="leave out the abusive agent (900 kB tasks, heartbeat and comment floods, "
            "2,000 queues)",
        )
        parser.add_argument(
            "--output",
            type=Path,
            help="where to write the JSON (default TASKBOARD_DATA_DIR/soak/results.json)",
        )
        parser.add_argument(
            "--database-url",
            help="PostgreSQL server to soak on (a scratch database), instead of the configured one",
        )
        parser.add_argument(
            "--prefix",
            default="taskboard_soak",
            help="name prefix of the scratch databases (default taskboard_soak)",
        )
        parser.add_argument(
            "--keep", action="store_true", help="keep the scratch databases afterwards"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        seconds = options["seconds"] or options["minutes"] * 60
        if seconds <= 0 or options["interval"] <= 0 or options["agents"] < 1:
            raise CommandError("--minutes, --seconds, --interval and --agents must be positive")
        if options["database_url"]:
            server = ServerParams.from_url(options["database_url"])
        else:
            server = ServerParams.from_django()
        output = options["output"] or Path(conf.data_dir()) / "soak" / "results.json"
        try:
            data = soak.run(
                seconds=seconds,
                interval=options["interval"],
                server_params=server,
                application_database=settings.DATABASES["default"]["NAME"],
                output=output.resolve(),
                in_place=not options["database_url"],
                prefix=options["prefix"],
                keep=options["keep"],
                agents=options["agents"],
                streams=options["streams"],
                readers=options["readers"],
                rate=options["rate"],
                abuse=not options["no_abuse"],
                stdout=self.stdout,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if data["server_errors"]:
            raise CommandError(f"the load saw server errors: {data['server_errors']}")
