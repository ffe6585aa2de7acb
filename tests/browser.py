"""Driving the board in a real browser: headless Chromium through Playwright, against a
real uvicorn server (tests/live.py). The fixtures are registered in tests/conftest.py."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.factories import UserFactory
from tests.live import LiveServer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
PASSWORD = "secret-password"

requires_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)",
)


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Start Chromium for one test.

    Playwright's sync API keeps its event loop marked as running in this thread between
    calls. Django then takes the thread for an async context: it refuses the ORM unless
    DJANGO_ALLOW_ASYNC_UNSAFE is set, and hands out connections of their own (per context,
    not per thread), closed here. The browser is set up after the test database and torn
    down before it, so the database's own teardown runs outside that loop.
    """
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
            )
            try:
                yield chromium
            finally:
                chromium.close()
                connections.close_all()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def new_page(browser: Browser, server: LiveServer) -> Iterator[Callable[[], Page]]:
    """Return a function that opens a page in one browser context (one set of cookies).

    A script error on any page fails the test.
    """
    context = browser.new_context(base_url=server.url, viewport={"width": 1366, "height": 850})
    context.set_default_timeout(5000)
    errors: list[str] = []

    def open_page() -> Page:
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        return page

    yield open_page
    context.close()
    assert errors == [], "the page's script failed"


@pytest.fixture
def page(new_page: Callable[[], Page]) -> Page:
    return new_page()


@pytest.fixture
def person(fast_password_hashing: None) -> Any:
    return UserFactory.create(username="pat", password=PASSWORD)


def log_in(page: Page, user: Any) -> None:
    """Log in through the login form, as a person would, and wait for the live board."""
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/$"))
    page.get_by_label("Username").fill(user.username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(re.compile(r"/$"))
    wait_until_live(page)


def wait_until_live(page: Page) -> None:
    expect(page.locator(".live")).to_have_attribute("data-stream", "live")


def card(page: Page, column: str, task_id: int) -> Any:
    return page.locator(f'[data-column="{column}"] .card[data-task-id="{task_id}"]')


def count(page: Page, status: str) -> Any:
    return page.locator(f'.counts [data-count="{status}"]')
