"""``manage.py benchmark``: measure the board against its targets (taskboard.benchmark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from board import conf
from taskboard import benchmark
from taskboard.benchmark.harness import ServerParams


class Command(BaseCommand):
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
            + ", ".join(benchmark.SCENARIOS),
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
                    "--plot needs matplotlib: pip install 'taskboard[bench]'"
                ) from None
        if options["database_url"]:
            server = ServerParams.from_url(options["database_url"])
        else:
            server = ServerParams.from_django()
        output = options["output"] or Path(conf.data_dir()) / "benchmark" / "results.json"
        try:
            benchmark.run(
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
