"""Fan-out through Pushpin: 10,000 SSE streams held in Pushpin, two server processes.

The server under test is ``taskboard serve --pushpin --workers 2``: Pushpin listens on the
public port and passes every request to the two server processes, which answer a stream
request at once with GRIP instructions; Pushpin then holds the stream, and one server
process (the one whose relay holds the publisher's lock, board.live.grip) publishes each event
to Pushpin, which writes it to every held stream.

Helper processes (benchmarks.clients sse, one per CPU, each with its open-file
limit raised to the hard limit) open 10,000 streams (2,000 with ``--quick``) through
Pushpin with one agent's token. Before any event is made the streams settle: Pushpin
recovers each newly subscribed stream once, about a second after it subscribes, through
its ``next`` link (10 links a second, 100 streams of one token to a link), and the
scenario waits until the server and Pushpin are idle again. Then this process creates
tasks at 5 per second (board.transitions.create, for 20 s, 5 s with ``--quick``: the
fan-out scenario's 50,000 deliveries a second, over ten times the streams) and notes
when each commit returned; each helper notes when each "created" event arrives on each
of its streams.
The latency is arrival minus commit over every (stream, event) pair, put together from
every helper's latencies (to 0.1 ms), once every event has arrived on every stream or none
has for 5 s (so that a late event counts in the latency and only a lost one as
missing). The server's database connections and memory are sampled per server process
from the first stream opened to the last event delivered.

The load generators run on the same two cores as the server and Pushpin (at full size
50,000 deliveries a second to read), so the latency includes the time a helper takes to
read what has arrived.

Skipped (with a note) when Pushpin is not installed (Debian: ``apt-get install pushpin``).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.fanout import add_delivery_figures, produce
from benchmarks.harness import Helper, Sampler, ScenarioResult, create_agents


@dataclass(frozen=True)
class Sizes:
    streams: int
    seconds: float


QUICK = Sizes(streams=2_000, seconds=5.0)
FULL = Sizes(streams=10_000, seconds=20.0)
# Events per second: the fan-out scenario's 50,000 deliveries a second (1,000 streams x 50
# events), spread over ten times the streams. At the fan-out scenario's 50 events a second,
# 10,000 streams are 500,000 deliveries a second, which the Python readers of this machine
# alone cannot take in (a run at that rate delivered 2% within 5 s of the last commit).
RATE = 5
TITLE = "Fan-out through Pushpin (SSE streams held in Pushpin, 2 server processes, 5 events/s)"
WORKERS = 2


def helper_count() -> int:
    """One helper per CPU this process may use (at least one, at most four)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cpus or 1))


def wait_for_deliveries(helpers: list[Helper], expected: int, quiet: float = 5.0) -> float:
    """Wait until the helpers have received ``expected`` events, or none for ``quiet``
    seconds (at most two minutes); return how long that took. Late events then count in
    the latency rather than as lost."""
    started = last_change = time.monotonic()
    arrived = -1
    while time.monotonic() - started < 120:
        time.sleep(0.5)
        now_arrived = 0
        for helper in helpers:
            helper.send({"arrived": True})
            now_arrived += helper.read(60)["arrived"]
        if now_arrived >= expected:
            break
        if now_arrived != arrived:
            arrived, last_change = now_arrived, time.monotonic()
        elif time.monotonic() - last_change > quiet:
            break
    return time.monotonic() - started


def combine(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Put the helpers' latencies together: count and percentiles over all of them, each
    as a helper picks it (the value at rank ``count * q / 100``), from their buckets of
    0.1 ms (a bucket's middle)."""
    counts: dict[int, int] = {}
    for report in reports:
        for tenths, count in report["buckets"].items():
            counts[int(tenths)] = counts.get(int(tenths), 0) + count
    ordered = sorted(counts.items())
    total = sum(counts.values())

    def pick(q: float) -> float:
        if not total:
            return -1.0
        rank = min(total - 1, int(total * q / 100))
        seen = 0
        for tenths, count in ordered:
            seen += count
            if seen > rank:
                return (tenths + 0.5) / 10
        return (ordered[-1][0] + 0.5) / 10

    return {
        "count": total,
        "unmatched": sum(report["unmatched"] for report in reports),
        "p50": pick(50),
        "p90": pick(90),
        "p99": pick(99),
        "max": max((report["max"] for report in reports), default=-1.0),
        "histogram": [pick(q) for q in range(0, 101, 2)],
    }


def run(ctx: Any, result: ScenarioResult) -> None:
    if shutil.which("pushpin") is None:
        message = "skipped: pushpin is not installed (Debian: apt-get install pushpin)"
        ctx.progress(message)
        result.note(message)
        return
    sizes = ctx.pick(QUICK, FULL)
    streams, seconds = sizes.streams, sizes.seconds
    helpers_wanted = helper_count()
    with ctx.database("fanout_pushpin") as database:
        ((actor, token),) = create_agents(1)
        with ctx.server(database, workers=WORKERS, pushpin=True) as server:
            ctx.progress(f"opening {streams:,} streams through Pushpin, {helpers_wanted} helpers")
            shares = [streams // helpers_wanted] * helpers_wanted
            shares[0] += streams - sum(shares)
            helpers: list[Helper] = []
            try:
                with Sampler(server) as sampler:
                    opened = time.monotonic()
                    for share in shares:
                        helpers.append(
                            Helper(
                                "sse", "--url", server.url, "--token", token, "--count", str(share)
                            )
                        )
                    readies = [helper.read(600) for helper in helpers]
                    ready = sum(answer["ready"] for answer in readies)
                    opening = time.monotonic() - opened
                    ctx.progress(f"{ready:,} streams open in {opening:.0f} s; letting them settle")
                    # Pushpin recovers each new stream once, about a second after it
                    # subscribed, 1,000 streams a second: wait for that to be over.
                    time.sleep(2)
                    server.settle(timeout=max(30.0, streams / 1_000 * 3))
                    idle_rss = server.rss_mb()
                    ctx.progress(f"{RATE} events/s for {seconds:.0f} s")
                    commits = produce(actor, seconds, RATE)
                    waited = wait_for_deliveries(helpers, len(commits) * streams)
                    for helper in helpers:
                        helper.send({"commits": commits})
                    report = combine([helper.read(600) for helper in helpers])
            finally:
                for helper in helpers:
                    helper.close()
    expected = len(commits) * streams
    add_delivery_figures(result, report, expected)
    sampler.add_figures(result)
    result.note_reopened(readies)
    result.note(
        f"{streams:,} streams through Pushpin to {WORKERS} server processes, opened by "
        f"{len(helpers)} helper processes in {opening:.0f} s; {len(commits):,} events in "
        f"{seconds:.0f} s; {report['count']:,} deliveries of {expected:,} "
        f"(counted {waited:.1f} s after the last commit) "
        f"({report['unmatched']:,} of events not made here); p90 {report['p90']:.1f} ms, "
        f"max {report['max']:.1f} ms; memory of serve, its processes and Pushpin with the "
        f"streams open and idle {idle_rss:.0f} MB; connections active at once (max) "
        f"{sampler.max_active}, held by no server process (max) {sampler.max_unattributed}"
    )
    result.extra["latency_percentiles_ms"] = report["histogram"]
