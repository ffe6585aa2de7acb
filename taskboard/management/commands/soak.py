"""``taskboard soak``: a mixed load against a fresh server, watching it for leaks
(benchmarks/, from a checkout: taskboard.repository)."""

from taskboard.repository import benchmarks_command

Command = benchmarks_command("Soak")
