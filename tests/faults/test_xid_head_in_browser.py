"""The board past a power of ten of transaction ids, in a real browser.

Event positions are transaction ids. Compared as text, "9999" sorts after "10000": a board
drawn once the database has crossed 10,000 transactions would resume its stream from an
old event, replay everything since and count it twice. This burns transaction ids on a
new board's own embedded PostgreSQL until their number of digits grows, with events on
both sides, then opens the board in headless Chromium.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, Page, expect

from board.pages.views import OPEN_COLUMN_LIMIT
from tests.browser import card, count, requires_chromium, wait_until_live
from tests.faults.conftest import FreshBoard

pytestmark = [pytest.mark.slow, pytest.mark.once, requires_chromium]

AFTER = OPEN_COLUMN_LIMIT + 30  # tasks created past the power of ten

# Record what the page's EventSource is asked for and what it receives.
RECORD_STREAM = """
(() => {
  const Native = window.EventSource;
  window.recorded = {urls: [], ids: []};
  window.EventSource = class extends Native {
    constructor(url, options) {
      super(url, options);
      window.recorded.urls.push(String(url));
      this.addEventListener("task_event", (message) => {
        window.recorded.ids.push(Number(message.lastEventId));
      });
    }
  };
})();
"""

# Burn transaction ids fast: one COMMIT per loop turn, on the server, without waiting for
# the WAL flush of each.
BURN = """
CREATE PROCEDURE pg_temp.burn_xids(n integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..n LOOP
        PERFORM pg_current_xact_id();
        COMMIT;
    END LOOP;
END
$$
"""


def burn_past_the_next_power_of_ten(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Take transaction ids until their decimal length grows; return (before, after)."""
    before = int(conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0])  # type: ignore[index]
    target = 10 ** len(str(before))
    conn.execute("SET synchronous_commit = off")
    conn.execute(BURN)
    conn.execute("CALL pg_temp.burn_xids(%s)", [target - before + 5])
    after = int(conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0])  # type: ignore[index]
    return before, after


class Agent:
    def __init__(self, board: FreshBoard) -> None:
        self.http = httpx.Client(
            base_url=f"{board.server.url}/api/v1",
            headers={"Authorization": f"Bearer {board.agent_token}"},
            timeout=30,
        )

    def create(self, title: str, priority: int = 0) -> int:
        response = self.http.post("/tasks/", json={"title": title, "priority": priority})
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    def work(self, claims: int, completes: int) -> None:
        response = self.http.post("/tasks/claim/", json={"limit": claims, "lease_seconds": 600})
        tasks = response.json()["tasks"]
        assert len(tasks) == claims, response.text
        for task in tasks[:completes]:
            done = self.http.post(
                f"/tasks/{task['id']}/complete/", json={"lease_token": task["lease_token"]}
            )
            assert done.status_code == 200, done.text


@pytest.fixture
def board_page(browser: Browser, fresh_board: FreshBoard) -> Iterator[Page]:
    context = browser.new_context(base_url=fresh_board.server.url)
    context.set_default_timeout(10_000)
    errors: list[str] = []
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.add_init_script(RECORD_STREAM)
    yield page
    context.close()
    assert errors == [], "the page's script failed"


def test_the_board_past_ten_thousand_transactions_counts_and_draws_what_the_database_holds(
    fresh_board: FreshBoard, board_page: Page
) -> None:
    agent = Agent(fresh_board)
    with psycopg.connect(fresh_board.cluster.conninfo(), autocommit=True) as db:
        for n in range(12):
            agent.create(f"before {n}")
        agent.work(claims=4, completes=2)
        before, after = burn_past_the_next_power_of_ten(db)
        assert len(str(after)) > len(str(before))
        # More than a column shows (board.pages.views.OPEN_COLUMN_LIMIT): the page counts the
        # tasks it does not draw from the events alone.
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda n: agent.create(f"after {n}"), range(AFTER)))
        agent.work(claims=6, completes=3)
        event_txids = [
            int(txid) for (txid,) in db.execute("SELECT txid::text FROM task_events").fetchall()
        ]
        assert min(event_txids) < 10 ** len(str(before)) <= max(event_txids)
        head = int(db.execute("SELECT max(id) FROM task_events").fetchone()[0])  # type: ignore[index]

        page = board_page
        page.goto("/accounts/login/")
        page.get_by_label("Username").fill("admin")
        page.get_by_label("Password").fill(fresh_board.admin_password)
        page.get_by_role("button", name="Log in").click()
        expect(page).to_have_url(re.compile(r"/$"))
        wait_until_live(page)

        sentinel = agent.create("after the page loaded", priority=10)  # drawn first
        expect(card(page, "pending", sentinel)).to_be_visible()
        sentinel_event = int(
            db.execute("SELECT id FROM task_events WHERE task_id = %s", [sentinel]).fetchone()[0]  # type: ignore[index]
        )

        counts: dict[str, int] = dict(
            db.execute("SELECT status, count(*) FROM tasks GROUP BY status").fetchall()
        )
        by_column = {
            column: {
                task_id
                for (task_id,) in db.execute(
                    "SELECT id FROM tasks WHERE status = ANY(%s)", [statuses]
                ).fetchall()
            }
            for column, statuses in {
                "pending": ["pending"],
                "in_progress": ["in_progress"],
                "finished": ["done", "cancelled"],
            }.items()
        }
    assert counts == {"pending": 12 + AFTER - 10 + 1, "in_progress": 5, "done": 5}
    for status in ("pending", "in_progress", "escalated", "done", "cancelled"):
        expect(count(page, status)).to_have_text(str(counts.get(status, 0)))
    for column, expected in by_column.items():
        drawn = page.locator(f'[data-column="{column}"] .card').evaluate_all(
            "cards => cards.map(card => Number(card.dataset.taskId))"
        )
        assert len(drawn) == len(set(drawn)), f"a card drawn twice in {column}"
        assert set(drawn) <= expected, f"a card in {column} that the database has elsewhere"
        assert len(drawn) >= min(len(expected), OPEN_COLUMN_LIMIT), f"cards missing in {column}"

    # The stream resumed from the newest event, and had nothing to replay: the next event
    # was the first the page received.
    [url] = page.evaluate("window.recorded.urls")
    assert parse_qs(urlsplit(url).query)["lastEventId"] == [str(head)]
    assert page.evaluate("window.recorded.ids") == [sentinel_event], "old events replayed"
