"""A server process's memory under answers that carry a large task."""

from __future__ import annotations

from typing import Any

import httpx
import psutil
import pytest

from tests import processes
from tests.factories import TokenFactory, UserFactory
from tests.processes import ServeProcess

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
@pytest.mark.once
def test_answers_that_carry_a_huge_task_leave_the_server_process_s_memory_flat(
    tmp_path: Any,
) -> None:
    """300 GETs of a task with a 0.93 MB description and 150 heartbeats on it (each
    answered with the whole task) through the API: each answer's objects are freed when
    it has been sent, not when the garbage collector next makes a full collection."""
    token = TokenFactory.create(user=UserFactory.create(username="hoarder"))
    server = ServeProcess(
        tmp_path / "serve.log",
        "--workers",
        "1",
        env={"DATABASE_URL": processes.tests_database_url()},
    ).wait_healthy()
    try:
        worker = psutil.Process(server.pid)  # with one worker, uvicorn serves in it
        headers = {"Authorization": f"Bearer {token.key}"}
        with httpx.Client(base_url=f"{server.url}/api/v1/", headers=headers, timeout=30) as api:
            task = api.post("tasks/", json={"title": "huge", "description": "x" * 930_000})
            assert task.status_code == 201, task.text
            task_id = task.json()["id"]
            claimed = api.post("tasks/claim/", json={"queues": ["default"]})
            [lease] = [t["lease_token"] for t in claimed.json()["tasks"] if t["id"] == task_id]
            # Warm up: the allocator's arenas and the process's caches reach their size.
            for _ in range(10):
                assert api.get(f"tasks/{task_id}/").status_code == 200
            before = worker.memory_info().rss
            for _ in range(300):
                assert api.get(f"tasks/{task_id}/").status_code == 200
            for n in range(150):
                beat = api.post(
                    f"tasks/{task_id}/heartbeat/",
                    json={"lease_token": lease, "progress": {"step": n}},
                )
                assert beat.status_code == 200, beat.text
            after = worker.memory_info().rss
    finally:
        server.stop()

    grown = (after - before) / 2**20
    print(f"RSS before {before / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB")
    assert grown < 64, f"the server process grew by {grown:.1f} MiB"


@pytest.mark.slow
@pytest.mark.once
def test_creating_huge_tasks_leaves_the_server_process_s_memory_flat(tmp_path: Any) -> None:
    """200 tasks created with a 0.93 MB description each: the validated body goes with
    its request, not with the garbage collector's next full collection."""
    token = TokenFactory.create(user=UserFactory.create(username="hoarder"))
    server = ServeProcess(
        tmp_path / "serve.log",
        "--workers",
        "1",
        env={"DATABASE_URL": processes.tests_database_url()},
    ).wait_healthy()
    try:
        worker = psutil.Process(server.pid)
        headers = {"Authorization": f"Bearer {token.key}"}
        body = {"title": "huge", "queue": "huge", "description": "x" * 930_000}
        with httpx.Client(base_url=f"{server.url}/api/v1/", headers=headers, timeout=30) as api:
            for _ in range(10):  # warm-up
                assert api.post("tasks/", json=body).status_code == 201
            before = worker.memory_info().rss
            for _ in range(200):
                created = api.post("tasks/", json=body)
                assert created.status_code == 201, created.text
            after = worker.memory_info().rss
    finally:
        server.stop()

    grown = (after - before) / 2**20
    print(f"RSS before {before / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB")
    assert grown < 24, f"the server process grew by {grown:.1f} MiB"
