"""``python -m benchmarks [ARGS]`` runs the benchmark and ``python -m benchmarks soak [ARGS]``
the soak, from a checkout with the server installed: the same as ``taskboard benchmark``
and ``taskboard soak`` (taskboard.commands: the settings, the embedded database)."""

import sys

from taskboard.commands import main

args = sys.argv[1:]
main(args if args[:1] == ["soak"] else ["benchmark", *args])
