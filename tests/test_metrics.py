"""GET /metrics: Prometheus' text format, read back with prometheus_client's own parser."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from django.db import connection
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from board import transitions
from board.notifications import deliveries
from tests import processes
from tests.factories import TokenFactory
from tests.live import LiveServer, StreamCollector
from tests.processes import ServeProcess, eventually, server_workers
from tests.test_health import assert_unavailable, database_unreachable

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


def scrape(client: Any) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """GET /metrics and parse it: {sample name: {sorted labels: value}}."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def one(samples: dict[str, Any], name: str, **labels: str) -> float:
    return float(samples[name][tuple(sorted(labels.items()))])


@pytest.fixture
def staff_api(api: Callable[[Any], APIClient], staff: Any) -> APIClient:
    return api(staff)


def test_it_counts_tasks_by_queue_and_status_as_get_queues_does(
    staff_api: APIClient, agent: Any
) -> None:
    for n in range(4):
        transitions.create(actor=agent, title=f"image {n}", queue="images")
    transitions.create(actor=agent, title="mail", queue="mail")
    done, failed, escalated = transitions.claim(actor=agent, queues=["images"], limit=3)
    transitions.complete(task_id=done.task.id, actor=agent, lease_token=done.lease_token)
    transitions.fail(
        task_id=failed.task.id, actor=agent, lease_token=failed.lease_token, error="no"
    )
    transitions.escalate(
        task_id=escalated.task.id, actor=agent, lease_token=escalated.lease_token, reason="?"
    )
    transitions.create(actor=agent, title="after", queue="mail", depends_on=[escalated.task.id])

    samples = scrape(staff_api)
    board = staff_api.get("/api/v1/queues/").json()

    assert {queue["name"] for queue in board} == {"images", "mail"}
    for queue in board:
        for status, count in queue["counts"].items():
            assert one(samples, "taskboard_tasks", queue=queue["name"], status=status) == count
    assert one(samples, "taskboard_tasks", queue="images", status="escalated") == 1
    assert one(samples, "taskboard_tasks", queue="mail", status="blocked") == 1
    assert one(samples, "taskboard_oldest_pending_task_age_seconds", queue="images") > 0
    assert one(samples, "taskboard_queue_paused", queue="images") == 0


def test_it_counts_events_by_type_as_the_log_holds_them(staff_api: APIClient, agent: Any) -> None:
    for n in range(5):
        transitions.create(actor=agent, title=f"task {n}")
    claims = transitions.claim(actor=agent, limit=5)  # one statement, five events
    for claim in claims[:2]:
        transitions.complete(task_id=claim.task.id, actor=agent, lease_token=claim.lease_token)

    samples = scrape(staff_api)
    with connection.cursor() as cursor:
        cursor.execute("SELECT type, count(*) FROM task_events GROUP BY type")
        in_the_log = dict(cursor.fetchall())

    assert in_the_log == {"created": 5, "claimed": 5, "completed": 2}
    for type_, count in in_the_log.items():
        assert one(samples, "taskboard_events_total", type=type_) == count


def test_concurrent_transitions_lose_no_count(staff_api: APIClient, agent: Any) -> None:
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def create_many() -> None:
        try:
            barrier.wait()
            for n in range(15):
                transitions.create(actor=agent, title=f"t{n}")
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=create_many) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert errors == []
    assert one(scrape(staff_api), "taskboard_events_total", type="created") == 90


def test_it_counts_webhook_deliveries_by_result(
    staff_api: APIClient, agent: Any, make_task: Callable[..., Any]
) -> None:
    from tests.test_webhooks import add_webhook, escalate

    add_webhook(staff_api)
    for _ in range(3):
        escalate(make_task, agent)
    first, second = deliveries.claim_deliveries(limit=2, lease_seconds=30)
    assert first.lease_token is not None and second.lease_token is not None
    deliveries.record_delivery(
        delivery_id=first.pk, lease_token=first.lease_token, delivered=True, status_code=200
    )
    deliveries.record_delivery(
        delivery_id=second.pk,
        lease_token=second.lease_token,
        delivered=False,
        status_code=500,
        error="answered 500",
        retry_in=60,
        horizon_seconds=3600,
    )

    samples = scrape(staff_api)

    assert one(samples, "taskboard_webhook_deliveries_total", result="delivered") == 1
    assert one(samples, "taskboard_webhook_deliveries_total", result="retried") == 1
    assert one(samples, "taskboard_webhook_deliveries_total", result="failed") == 0
    # The retried one and the one never tried wait.
    assert one(samples, "taskboard_webhook_deliveries_pending") == 2


def test_claims_are_observed_in_the_latency_histogram(staff_api: APIClient, agent: Any) -> None:
    before = scrape(staff_api)
    transitions.create(actor=agent, title="one")
    agent_api = APIClient()
    agent_api.force_authenticate(agent)
    assert len(agent_api.post("/api/v1/tasks/claim/", {}, format="json").json()["tasks"]) == 1
    # Finds nothing: a claim all the same.
    assert agent_api.post("/api/v1/tasks/claim/", {}, format="json").json()["tasks"] == []
    after = scrape(staff_api)

    count = "taskboard_claim_duration_seconds_count"
    assert one(after, count) - one(before, count) == 2
    assert one(after, "taskboard_claim_duration_seconds_sum") > one(
        before, "taskboard_claim_duration_seconds_sum"
    )


@pytest.mark.parametrize(
    "accept",
    [
        "text/plain; version=0.0.4",
        "application/openmetrics-text; version=1.0.0",
        "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    ],
)
def test_a_scraper_that_asks_for_its_own_format_is_answered(
    staff_api: APIClient, accept: str
) -> None:
    response = staff_api.get("/metrics", HTTP_ACCEPT=accept)

    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")


def test_a_refusal_is_json_whatever_the_scraper_accepts() -> None:
    response = Client().get("/metrics", HTTP_ACCEPT="text/plain; version=0.0.4")

    assert response.status_code == 401
    assert response.json()["error"] == "not_authenticated"


def test_it_refuses_a_client_without_credentials_with_the_apis_401() -> None:
    response = Client().get("/metrics")

    assert response.status_code == 401
    assert response.json()["error"] == "not_authenticated"
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_it_refuses_an_agent_that_is_not_staff_with_the_apis_403(
    api: Callable[[Any], APIClient], agent: Any
) -> None:
    response = api(agent).get("/metrics")

    assert response.status_code == 403
    assert response.json()["error"] == "permission_denied"


def test_it_refuses_staff_limited_to_queues_who_may_not_see_every_queues_counts(
    api: Callable[[Any], APIClient],
) -> None:
    from board.access import limit_queues
    from tests.factories import StaffFactory

    limited = StaffFactory.create(username="ops-images")
    limit_queues(limited, ["images"])
    response = api(limited).get("/metrics")

    assert response.status_code == 403
    assert response.json()["error"] == "permission_denied"


def test_it_answers_anyone_when_the_metrics_are_public(settings: Any) -> None:
    settings.TASKBOARD_METRICS_PUBLIC = True

    samples = scrape(Client())

    assert "taskboard_claim_duration_seconds_count" in samples


def test_a_failed_token_on_metrics_counts_against_the_address(
    api: Callable[[Any], APIClient], settings: Any
) -> None:
    settings.TASKBOARD_AUTH_FAILURE_LIMIT = 2
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer not-a-token")

    statuses = [client.get("/metrics").status_code for _ in range(3)]

    assert statuses == [401, 401, 429]


def test_it_answers_503_while_the_database_is_unreachable(
    staff_api: APIClient, settings: Any
) -> None:
    staff_api.get("/metrics")  # the token is cached: the scrape itself meets the outage
    with database_unreachable():
        response = staff_api.get("/metrics")

    assert_unavailable(response)


@pytest.mark.slow
def test_a_live_server_reports_its_streams_waiting_claims_and_relay(
    server: LiveServer, staff: Any, agent: Any, open_raw_connection: Any
) -> None:
    token = TokenFactory.create(user=staff)
    headers = {"Authorization": f"Bearer {token.key}"}

    def live_scrape() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        response = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)
        assert response.status_code == 200, response.text
        samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = (
                    sample.value
                )
        return samples

    answers: list[int] = []
    waiting = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                f"{server.url}/api/v1/tasks/claim/",
                json={"wait": 3, "queues": ["nothing-here"]},
                headers=headers,
                timeout=10,
            ).status_code
        )
    )
    with StreamCollector(f"{server.url}/api/v1/stream/", headers):
        waiting.start()
        time.sleep(0.5)
        samples = live_scrape()
        assert one(samples, "taskboard_open_streams") == 1
        assert one(samples, "taskboard_waiting_claims") == 1
        assert one(samples, "taskboard_relay_connected") == 1
        assert one(samples, "taskboard_relay_lag_seconds") < 1

        # A transaction that holds an id and stays open holds back every event committed
        # after it (the relay passes events on in commit-safe order): the lag grows.
        holder = open_raw_connection()
        holder.execute("SELECT pg_current_xact_id()")
        transitions.create(actor=agent, title="held back")
        time.sleep(1.2)
        assert one(live_scrape(), "taskboard_relay_lag_seconds") >= 1
        holder.rollback()
        time.sleep(0.3)
        assert one(live_scrape(), "taskboard_relay_lag_seconds") == 0
    waiting.join(10)
    assert answers == [200]
    time.sleep(0.2)
    samples = live_scrape()
    assert one(samples, "taskboard_open_streams") == 0
    assert one(samples, "taskboard_waiting_claims") == 0


def test_the_alert_rules_and_scrape_configuration_are_valid_yaml() -> None:
    rules = yaml.safe_load((ROOT / "docs/prometheus/alerts.yml").read_text())
    scrape_config = yaml.safe_load((ROOT / "docs/prometheus/prometheus.yml").read_text())

    alerts = {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"]}
    assert set(alerts) == {
        "TaskboardOldestPendingTaskTooOld",
        "TaskboardEscalationsPerHour",
        "TaskboardRelayLagging",
    }
    for rule in alerts.values():
        assert rule["expr"] and rule["labels"]["severity"] and rule["annotations"]["summary"]
    assert (
        "taskboard_oldest_pending_task_age_seconds"
        in alerts["TaskboardOldestPendingTaskTooOld"]["expr"]
    )
    assert (
        'taskboard_events_total{type="escalated"}' in alerts["TaskboardEscalationsPerHour"]["expr"]
    )
    assert "taskboard_relay_lag_seconds" in alerts["TaskboardRelayLagging"]["expr"]
    [job] = scrape_config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert json.dumps(job)  # plain data all the way down


@pytest.mark.slow
@pytest.mark.once
def test_under_serve_workers_every_worker_counts_every_workers_claims(
    tmp_path: Path, staff: Any, agent: Any
) -> None:
    headers = {"Authorization": f"Bearer {TokenFactory.create(user=staff).key}"}
    agent_headers = {"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"}
    for n in range(5):
        transitions.create(actor=agent, title=f"task {n}")
    server = ServeProcess(
        tmp_path / "serve.log",
        "--workers",
        "2",
        env={"DATABASE_URL": processes.tests_database_url(), "TASKBOARD_METRICS_PUBLIC": "false"},
    ).wait_healthy()
    try:
        first, second = eventually(lambda: server_workers(server.pid, 2), what="two workers")

        def claims_counted() -> float:
            # A new connection per request: the worker that is not stopped answers it.
            response = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)
            assert response.status_code == 200, response.text
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    if sample.name == "taskboard_claim_duration_seconds_count":
                        return sample.value
            raise AssertionError("no claim histogram")

        # Every claim is made by the first worker, while the second is stopped...
        second.suspend()
        try:
            for _ in range(5):
                response = httpx.post(
                    f"{server.url}/api/v1/tasks/claim/", json={}, headers=agent_headers, timeout=10
                )
                assert response.status_code == 200 and response.json()["tasks"]
            assert claims_counted() == 5
        finally:
            second.resume()
        # ...and the second, answering alone, counts them all the same.
        first.suspend()
        try:
            assert claims_counted() == 5
        finally:
            first.resume()
    finally:
        server.stop()
