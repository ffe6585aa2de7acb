"""Server CPU time per API request, for comparing two request pipelines.

Start ``manage.py serve`` from a checkout (its own .venv and embedded PostgreSQL), drive
claim+complete cycles through the API (create, claim, complete: three requests each) from
four threads, and read the server process's CPU time (user + system) over them. CPU time,
unlike requests per second, hardly depends on what else the machine runs, so two
checkouts measured one after the other on a busy machine still compare.

    python benchmarks/measurements/handler_cpu.py CHECKOUT PORT [CYCLES]

CHECKOUT must have been migrated (``.venv/bin/python manage.py migrate``). Prints one JSON
line: requests, server CPU ms per request, wall seconds, the server's threads and RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import httpx
import psutil


def main(checkout: str, port: int, cycles: int) -> None:
    python = f"{checkout}/.venv/bin/python"
    name = f"cpu-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(
        [python, "manage.py", "create_agent", name],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    )
    headers = {"Authorization": f"Bearer {made.stdout.strip().splitlines()[-1]}"}
    server = subprocess.Popen(
        [python, "manage.py", "serve", "--no-migrate", "--port", str(port)],
        cwd=checkout,
        env={**os.environ, "TASKBOARD_ACCESS_LOG": "false"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

        def work(n: int) -> None:
            with httpx.Client(base_url=f"{base}/api/v1", headers=headers) as client:
                for _ in range(n):
                    client.post("/tasks/", json={"title": "t", "queue": name}).raise_for_status()
                    claimed = client.post("/tasks/claim/", json={"queues": [name]})
                    for task in claimed.json()["tasks"]:
                        client.post(
                            f"/tasks/{task['id']}/complete/",
                            json={"lease_token": task["lease_token"]},
                        ).raise_for_status()

        work(30)  # warm up: imports, the first connections
        process = psutil.Process(server.pid)
        before, started = process.cpu_times(), time.perf_counter()
        threads = [threading.Thread(target=work, args=(cycles // 4,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        after, wall = process.cpu_times(), time.perf_counter() - started
        cpu = after.user - before.user + after.system - before.system
        requests = 3 * 4 * (cycles // 4)
        print(
            json.dumps(
                {
                    "checkout": checkout,
                    "requests": requests,
                    "server_cpu_ms_per_request": round(1000 * cpu / requests, 2),
                    "wall_seconds": round(wall, 1),
                    "threads": process.num_threads(),
                    "rss_mb": round(process.memory_info().rss / 2**20, 1),
                }
            )
        )
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 400)
