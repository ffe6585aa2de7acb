"""``taskboard soak``: a mixed load for minutes against a ``taskboard serve``, watching the
server's memory, file descriptors and database connections for leaks.

It runs in a scratch database and against a server started for the purpose, as the
benchmark does (``harness.Scratch`` and ``harness.Server``). The load runs in threads of
this process, over HTTP only:

- agents claim (with a short ``wait``), sometimes heartbeat, then complete, fail, release
  or abandon the task (its 5 s lease then expires and the next claim records it);
- a creator adds tasks at a steady rate;
- stream clients connect to ``/api/v1/stream/``, read for a few seconds and hang up,
  half of them resuming with ``Last-Event-ID``;
- readers list tasks, read tasks and their events, page through ``/api/v1/events/`` and
  check ``/healthz``;
- beside them, one abusive agent (unless ``abuse`` is off) does what any token may: it
  creates tasks with 900 kB descriptions and floods each with heartbeats while holding it,
  floods a task with 10 kB comments, and spreads tasks over 2,000 queues. Every server
  process reads every event it makes; its memory must stay flat all the same.

Every interval it prints one line: requests per second, answers by class, and the server's
RSS (all its processes, and the largest one), open file descriptors and database
connections; at the end, each of those at the start, at its maximum and at the end. A 5xx
other than 503 is a failure.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import Progress, Scratch, Server, ServerParams, create_agents

LEASE_SECONDS = 5
# The normal load's queues; the abusive agent keeps to its own, so that the normal agents
# do not spend their time on its tasks.
QUEUES = ["default", "images", "mail"]
HUGE_DESCRIPTION_BYTES = 900_000
FLOOD_HEARTBEATS = 100  # per huge task, then it is completed and another made
COMMENT_BYTES = 10_000
ABUSE_QUEUES = 2_000


@dataclass
class Sample:
    at: float  # seconds since the load started
    requests: int  # answered since the previous sample
    rss_mb: float
    fds: int
    connections: int
    # The largest server process's RSS: every process reads every event, so each must
    # stay flat, not only their sum.
    largest_rss_mb: float = 0.0


@dataclass
class Tally:
    """What the load saw, shared by its threads."""

    statuses: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    answered: int = 0
    task_ids: deque[int] = field(default_factory=lambda: deque(maxlen=2_000))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, response: httpx.Response) -> None:
        with self.lock:
            self.statuses[str(response.status_code)] += 1
            self.answered += 1

    def failure(self, exc: Exception) -> None:
        with self.lock:
            self.statuses[type(exc).__name__] += 1

    def did(self, action: str, count: int = 1) -> None:
        with self.lock:
            self.actions[action] += count

    def server_errors(self) -> dict[str, int]:
        """Return the 5xx answers other than 503, by status."""
        return {
            status: count
            for status, count in self.statuses.items()
            if (status.startswith("5") and status != "503") or status == "server exited"
        }


class Load:
    """The load's threads; each loops until :meth:`stop`."""

    def __init__(
        self,
        url: str,
        agents: list[tuple[str, str]],
        *,
        streams: int,
        readers: int,
        rate: float,
        abuser: str | None = None,
        seed: int = 8,
    ) -> None:
        self.url = url
        self.tokens = [token for _, token in agents]
        self.tally = Tally()
        self.stopping = threading.Event()
        self.rate = rate
        self.random = random.Random(seed)
        self.threads = [
            *(self._thread(self._agent, token) for token in self.tokens),
            self._thread(self._creator, self.tokens[0]),
            *(
                self._thread(self._streamer, self.tokens[i % len(self.tokens)])
                for i in range(streams)
            ),
            *(
                self._thread(self._reader, self.tokens[i % len(self.tokens)])
                for i in range(readers)
            ),
        ]
        if abuser is not None:
            self.threads += [
                self._thread(self._hoarder, abuser),
                self._thread(self._comment_flood, abuser),
                self._thread(self._queue_spreader, abuser),
            ]

    def _token(self, index: int) -> str:
        return self.tokens[index % len(self.tokens)]

    def _thread(self, target: Callable[[str], None], token: str) -> threading.Thread:
        return threading.Thread(target=target, args=(token,), daemon=True)

    def start(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(15)

    @contextlib.contextmanager
    def _client(self, token: str) -> Iterator[httpx.Client]:
        with httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(30, connect=10),
        ) as client:
            yield client

    def _call(self, client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request; return its JSON on a 2xx, else None (tallied either way)."""
        try:
            response = client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.tally.failure(exc)
            self.stopping.wait(0.1)
            return None
        self.tally.answer(response)
        if response.is_success:
            return response.json()
        if response.status_code == 503:
            self.stopping.wait(0.2)
        return None

    def _agent(self, token: str) -> None:
        rng = random.Random(token)
        with self._client(token) as client:
            while not self.stopping.is_set():
                claimed = self._call(
                    client,
                    "POST",
                    "/api/v1/tasks/claim/",
                    json={"lease_seconds": LEASE_SECONDS, "wait": 1, "queues": QUEUES},
                )
                for task in claimed["tasks"] if claimed else []:
                    self._work(client, rng, task)

    def _work(self, client: httpx.Client, rng: random.Random, task: dict[str, Any]) -> None:
        path = f"/api/v1/tasks/{task['id']}"
        lease = {"lease_token": task["lease_token"]}
        if rng.random() < 0.3:
            self._call(client, "POST", f"{path}/heartbeat/", json={**lease, "progress": {"n": 1}})
        roll = rng.random()
        if roll < 0.80:
            action, body = "complete", {**lease, "result": {"ok": True}}
        elif roll < 0.92:
            action, body = "fail", {**lease, "error": "soak: a failure", "retry_after": 0}
        elif roll < 0.97:
            action, body = "release", lease
        else:
            self.tally.did("abandon")  # its lease expires; a later claim records that
            return
        if self._call(client, "POST", f"{path}/{action}/", json=body) is not None:
            self.tally.did(action)

    def _creator(self, token: str) -> None:
        rng = random.Random(token + "creator")
        started = time.monotonic()
        created = 0
        with self._client(token) as client:
            while not self.stopping.is_set():
                due = started + created / self.rate - time.monotonic()
                if due > 0:
                    self.stopping.wait(due)
                created += 1
                task = self._call(
                    client,
                    "POST",
                    "/api/v1/tasks/",
                    json={
                        "title": f"soak {created}",
                        "payload": {"n": created},
                        "priority": rng.randint(-5, 5),
                        "queue": rng.choice(QUEUES),
                    },
                )
                if task is not None:
                    self.tally.task_ids.append(task["id"])
                    self.tally.did("create")

    def _streamer(self, token: str) -> None:
        rng = random.Random(token + str(id(threading.current_thread())))
        last: str | None = None
        with self._client(token) as client:
            while not self.stopping.is_set():
                hold = rng.uniform(0.5, 6.0)
                headers = {"Accept": "text/event-stream"}
                if last is not None and rng.random() < 0.5:
                    headers["Last-Event-ID"] = last
                opened = time.monotonic()
                try:
                    # A short read timeout: an idle stream is hung up on like a busy one.
                    timeout = httpx.Timeout(30, read=hold)
                    with client.stream(
                        "GET", "/api/v1/stream/", headers=headers, timeout=timeout
                    ) as response:
                        self.tally.answer(response)
                        if response.status_code != 200:
                            self.stopping.wait(0.5)
                            continue
                        self.tally.did("stream")
                        events = 0
                        for line in response.iter_lines():
                            if line.startswith("id:"):
                                last = line[3:].strip()  # also the opening position
                            elif line.startswith("data:"):
                                events += 1
                            if time.monotonic() - opened > hold or self.stopping.is_set():
                                break  # hang up, as a closed tab does
                        self.tally.did("streamed event", events)
                except httpx.ReadTimeout:
                    pass
                except httpx.HTTPError as exc:
                    self.tally.failure(exc)
                    self.stopping.wait(0.5)

    def _reader(self, token: str) -> None:
        rng = random.Random(token + "reader")
        after = 0
        with self._client(token) as client:
            while not self.stopping.is_set():
                known = list(self.tally.task_ids)
                task_id = rng.choice(known) if known else 1
                choice = rng.randrange(5)
                if choice == 0:
                    status = rng.choice(["pending", "in_progress", "done", "escalated"])
                    self._call(client, "GET", "/api/v1/tasks/", params={"status": status})
                elif choice == 1:
                    self._call(client, "GET", f"/api/v1/tasks/{task_id}/")
                elif choice == 2:
                    self._call(client, "GET", f"/api/v1/tasks/{task_id}/events/")
                elif choice == 3:
                    page = self._call(
                        client, "GET", "/api/v1/events/", params={"after": after, "limit": 200}
                    )
                    if page and page["results"]:
                        after = page["results"][-1]["id"]
                else:
                    self._call(client, "GET", "/healthz")
                self.tally.did("read")
                self.stopping.wait(0.02)

    # -- the abusive agent ----------------------------------------------------------------

    def _hoarder(self, token: str) -> None:
        """Create a task with a 900 kB description, claim it and send heartbeats with small
        bodies as fast as they are answered, then complete it and start again."""
        made = 0
        with self._client(token) as client:
            while not self.stopping.is_set():
                made += 1
                queue = "abuse-huge"
                created = self._call(
                    client,
                    "POST",
                    "/api/v1/tasks/",
                    json={
                        "title": f"huge {made}",
                        "queue": queue,
                        "description": "x" * HUGE_DESCRIPTION_BYTES,
                    },
                )
                if created is None:
                    continue
                self.tally.did("abuse: huge task")
                claimed = self._call(
                    client, "POST", "/api/v1/tasks/claim/", json={"queues": [queue], "limit": 1}
                )
                for task in claimed["tasks"] if claimed else []:
                    lease = {"lease_token": task["lease_token"]}
                    path = f"/api/v1/tasks/{task['id']}"
                    for beat in range(FLOOD_HEARTBEATS):
                        if self.stopping.is_set():
                            break
                        body = {**lease, "progress": {"beat": beat}}
                        if self._call(client, "POST", f"{path}/heartbeat/", json=body) is None:
                            break
                        self.tally.did("abuse: heartbeat")
                    self._call(client, "POST", f"{path}/complete/", json=lease)

    def _comment_flood(self, token: str) -> None:
        """Comment on one task of its own, 10 kB a comment, as fast as answered."""
        with self._client(token) as client:
            task = None
            while task is None and not self.stopping.is_set():
                task = self._call(
                    client, "POST", "/api/v1/tasks/", json={"title": "talk", "queue": "abuse-talk"}
                )
            body = {"body": "c" * COMMENT_BYTES}
            while task is not None and not self.stopping.is_set():
                if self._call(client, "POST", f"/api/v1/tasks/{task['id']}/comments/", json=body):
                    self.tally.did("abuse: comment")

    def _queue_spreader(self, token: str) -> None:
        """Create one task in each of 2,000 queues, then keep reading the queues' glance."""
        with self._client(token) as client:
            for n in range(ABUSE_QUEUES):
                if self.stopping.is_set():
                    return
                task = {"title": f"queue {n}", "queue": f"abuse-q{n:04}"}
                if self._call(client, "POST", "/api/v1/tasks/", json=task) is not None:
                    self.tally.did("abuse: queue")
            while not self.stopping.is_set():
                self._call(client, "GET", "/api/v1/queues/")
                self.stopping.wait(0.5)


def sample(server: Server, started: float, answered: int) -> Sample:
    import psutil

    assert server.process is not None
    # Summed over ``serve`` and every process under it, as the RSS is: with one process
    # per CPU, ``serve`` itself holds only its listening sockets.
    try:
        fds = sum(process.num_fds() for process in server.all_processes())
    except psutil.Error:
        fds = -1
    try:
        connections, _ = server.database.server_connections()
    except Exception:  # the database is away: say so, keep soaking
        connections = -1
    try:
        largest = max(server.rss_per_process_mb(), default=0.0)
    except psutil.Error:
        largest = 0.0
    return Sample(time.monotonic() - started, answered, server.rss_mb(), fds, connections, largest)


def line(current: Sample, previous: Sample | None, tally: Tally) -> str:
    span = current.at - (previous.at if previous else 0.0)
    rate = current.requests / span if span > 0 else 0.0
    with tally.lock:
        statuses = dict(tally.statuses)
    by_class: Counter[str] = Counter()
    for status, count in statuses.items():
        if status == "503" or not status[:1].isdigit():
            by_class[status] += count
        else:
            by_class[status[0] + "xx"] += count
    classes = " ".join(f"{name} {count:,}" for name, count in sorted(by_class.items()))
    return (
        f"[{current.at:6.0f} s] {rate:6.0f} req/s | RSS {current.rss_mb:6.1f} MB "
        f"(largest process {current.largest_rss_mb:6.1f}) | "
        f"fds {current.fds:4d} | db connections {current.connections:3d} | {classes}"
    ).rstrip(" |")


def summary(samples: list[Sample], tally: Tally, seconds: float) -> list[str]:
    def row(name: str, values: list[float], unit: str = "", digits: int = 0) -> str:
        first, top, last = (
            f"{value:>8,.{digits}f}" for value in (values[0], max(values), values[-1])
        )
        return f"  {name:<22} {first} {top} {last} {unit}".rstrip()

    total = sum(s.requests for s in samples)
    lines = [
        "",
        f"Soak: {seconds:.0f} s, {total:,} answers ({total / seconds:,.0f}/s)",
        f"  {'':<22} {'start':>8} {'max':>8} {'end':>8}",
        row("server RSS", [s.rss_mb for s in samples], "MB", digits=1),
        row("largest process RSS", [s.largest_rss_mb for s in samples], "MB", digits=1),
        row("open file descriptors", [float(s.fds) for s in samples]),
        row("database connections", [float(s.connections) for s in samples]),
        "  answers: "
        + ", ".join(f"{status} {count:,}" for status, count in sorted(tally.statuses.items())),
        "  actions: "
        + ", ".join(f"{action} {count:,}" for action, count in sorted(tally.actions.items())),
    ]
    return lines


def run(
    *,
    seconds: float,
    interval: float,
    server_params: ServerParams,
    application_database: str | None,
    output: Path,
    in_place: bool,
    prefix: str = "taskboard_soak",
    keep: bool = False,
    agents: int = 8,
    streams: int = 20,
    readers: int = 4,
    rate: float = 60.0,
    abuse: bool = True,
    stdout: Any,
) -> dict[str, Any]:
    """Soak a fresh server for ``seconds``; print and return the figures."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    progress = Progress()
    scratch = Scratch(server_params, prefix, progress, keep, in_place=in_place)
    output.parent.mkdir(parents=True, exist_ok=True)
    samples: list[Sample] = []
    load: Load | None = None
    try:
        scratch.prepare_template(application_database)
        with scratch.database("run") as database:
            accounts = create_agents(agents + 1 if abuse else agents)
            abuser = accounts.pop()[1] if abuse else None
            with Server(database, output.parent / "server.log", progress) as server:
                stdout.write(
                    f"Soaking {server.url} for {seconds:.0f} s: {agents} agents, {streams} "
                    f"streams connecting and dropping, {readers} readers, {rate:g} creates/s"
                    + (", and an abusive agent" if abuse else "")
                    + "\n"
                )
                stdout.flush()
                load = Load(
                    server.url,
                    accounts,
                    streams=streams,
                    readers=readers,
                    rate=rate,
                    abuser=abuser,
                )
                started = time.monotonic()
                samples.append(sample(server, started, 0))
                stdout.write(line(samples[-1], None, load.tally) + "\n")
                load.start()
                counted = 0
                while (elapsed := time.monotonic() - started) < seconds:
                    time.sleep(min(interval, seconds - elapsed))
                    answered = load.tally.answered
                    samples.append(sample(server, started, answered - counted))
                    counted = answered
                    stdout.write(line(samples[-1], samples[-2], load.tally) + "\n")
                    stdout.flush()
                    if server.process is not None and server.process.poll() is not None:
                        load.tally.statuses["server exited"] += 1
                        break
                load.stop()
                seconds = time.monotonic() - started
    finally:
        if load is not None:
            load.stopping.set()
        scratch.restore()
    assert load is not None
    for text in summary(samples, load.tally, seconds):
        stdout.write(text + "\n")
    data = {
        "seconds": round(seconds, 1),
        "agents": agents,
        "streams": streams,
        "readers": readers,
        "creates_per_second": rate,
        "abuse": abuse,
        "samples": [s.__dict__ for s in samples],
        "answers": dict(load.tally.statuses),
        "actions": dict(load.tally.actions),
        "server_errors": load.tally.server_errors(),
    }
    output.write_text(json.dumps(data, indent=2) + "\n")
    stdout.write(f"\nFigures written to {output}\n")
    return data
