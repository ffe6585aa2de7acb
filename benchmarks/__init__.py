"""``taskboard benchmark``: the board's figures, each compared within one run.

One module per scenario (``api``, ``peer``, ``history``, ``blocked``, ``queues``,
``fanout``, ``waiting``, ``churn``), each with a ``TITLE`` and a ``run(context, result)``
that records figures and their targets; ``harness`` holds what they share (scratch
databases, the server under test, timing), ``clients`` the load generators that run in
their own processes, ``runner`` the table and the JSON, ``plot`` the charts.
"""

from __future__ import annotations

from benchmarks.runner import SCENARIOS, run

__all__ = ["SCENARIOS", "run"]
