"""``taskboard benchmark``: measure the board against its targets (benchmarks/, from a
checkout: taskboard.repository)."""

from taskboard.repository import benchmarks_command

Command = benchmarks_command("Benchmark")
