"""The embedded PostgreSQL's postmaster killed with ``kill -9`` under load: the server
answers 503 (never 500) while the database is away, brings it back by itself, its streams
resume without a gap or a repeat, and nothing it acknowledged is lost."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from typing import Any

import httpx
import psycopg
import pytest

from tests.faults.conftest import FreshBoard
from tests.processes import StreamFollower, eventually

pytestmark = [
    pytest.mark.slow,
    pytest.mark.once,
    pytest.mark.skipif(
        bool(os.environ.get("DATABASE_URL")),
        reason="kills the embedded PostgreSQL's postmaster; DATABASE_URL names another server",
    ),
]


class Load:
    """Clients that create, claim and complete tasks through the API with no retries,
    recording every answer and what was acknowledged (a 2xx)."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.statuses: Counter[int | str] = Counter()
        self.created: list[int] = []
        self.completed: list[int] = []
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._creator, daemon=True),
            threading.Thread(target=self._creator, daemon=True),
            threading.Thread(target=self._worker, daemon=True),
        ]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)

    def _client(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.url}/api/v1",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=15,
        )

    def _send(self, client: httpx.Client, path: str, body: dict[str, Any]) -> Any:
        try:
            response = client.post(path, json=body)
        except httpx.TransportError as exc:
            self.statuses[type(exc).__name__] += 1
            return None
        self.statuses[response.status_code] += 1
        return response.json() if response.is_success else None

    def _creator(self) -> None:
        with self._client() as client:
            while not self.stopping.is_set():
                task = self._send(client, "/tasks/", {"title": "under a crash"})
                if task is not None:
                    self.created.append(task["id"])
                self.stopping.wait(0.02)

    def _worker(self) -> None:
        with self._client() as client:
            while not self.stopping.is_set():
                claimed = self._send(client, "/tasks/claim/", {"lease_seconds": 60})
                for task in claimed["tasks"] if claimed else []:
                    path = f"/tasks/{task['id']}/complete/"
                    if self._send(client, path, {"lease_token": task["lease_token"]}):
                        self.completed.append(task["id"])
                self.stopping.wait(0.02)


def test_a_killed_postmaster_comes_back_with_nothing_acknowledged_lost(
    fresh_board: FreshBoard,
) -> None:
    server, cluster = fresh_board.server, fresh_board.cluster
    follower = StreamFollower(server.url, fresh_board.agent_token, last_event_id=0).start()
    health: Counter[int | None] = Counter()
    try:
        with Load(server.url, fresh_board.agent_token) as load:
            eventually(lambda: len(load.completed) >= 10, timeout=30, what="some work")
            postmaster = cluster.postmaster_pid()
            assert postmaster is not None
            os.kill(postmaster, signal.SIGKILL)
            killed_at = time.monotonic()

            def healthy_again() -> bool:
                status = server.health(timeout=10)
                health[status] += 1
                return status == 200

            eventually(healthy_again, timeout=90, what="the server's recovery")
            recovered_after = time.monotonic() - killed_at
            done_before = len(load.completed)
            eventually(
                lambda: len(load.completed) >= done_before + 10, timeout=30, what="work again"
            )
        # The stream resumes: a new event reaches the follower.
        with httpx.Client(
            base_url=f"{server.url}/api/v1",
            headers={"Authorization": f"Bearer {fresh_board.agent_token}"},
        ) as client:
            sentinel = client.post("/tasks/", json={"title": "after the crash"}).json()["id"]

        with psycopg.connect(cluster.conninfo(), autocommit=True) as db:
            sentinel_event = db.execute(
                "SELECT id FROM task_events WHERE task_id = %s", [sentinel]
            ).fetchone()
            assert sentinel_event is not None
            eventually(
                lambda: sentinel_event[0] in follower.ids, timeout=60, what="the stream's resume"
            )
            in_order = [
                row[0] for row in db.execute("SELECT id FROM task_events ORDER BY txid, id")
            ]
            tasks = set(row[0] for row in db.execute("SELECT id FROM tasks"))
            done = set(row[0] for row in db.execute("SELECT id FROM tasks WHERE status = 'done'"))
            completions = Counter(
                row[0]
                for row in db.execute("SELECT task_id FROM task_events WHERE type = 'completed'")
            )
    finally:
        follower.close()

    assert set(load.created) <= tasks, "an acknowledged create is lost"
    assert set(load.completed) <= done, "an acknowledged completion is lost"
    assert all(completions[task_id] == 1 for task_id in load.completed)
    assert follower.ids == in_order, "the stream missed or repeated events"
    server_errors = {status for status in load.statuses if str(status).startswith("5")}
    assert server_errors <= {503}, load.statuses
    assert 503 in load.statuses or 503 in health, "the database was never seen away"
    assert server.server_errors() == []
    print(
        json.dumps(
            {
                "recovered after s": round(recovered_after, 1),
                "health answers": {str(k): v for k, v in health.items()},
                "load answers": {str(k): v for k, v in load.statuses.items()},
                "created": len(load.created),
                "completed": len(load.completed),
                "events streamed": len(follower.ids),
            }
        )
    )
