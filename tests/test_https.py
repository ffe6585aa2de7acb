"""TASKBOARD_HTTPS=true: Secure cookies, HSTS, the proxy's X-Forwarded-Proto and a
Content-Security-Policy, on the responses of a real ``serve``.

The server runs as a process of its own, since the setting is read at start-up. The tests
play the proxy, from 127.0.0.1, named in FORWARDED_ALLOW_IPS: uvicorn believes its
X-Forwarded-Proto, and from no other peer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.test import Client

from tests.processes import ServeProcess

# TLS in front of the board: the same on any PostgreSQL.
pytestmark = pytest.mark.once

CHROMIUM = Path("/usr/bin/chromium")
HTTPS = {"X-Forwarded-Proto": "https"}


@pytest.fixture(scope="module")
def https_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str]]:
    """A ``serve`` with TASKBOARD_HTTPS=true, and the first run's admin password."""
    data_dir = tmp_path_factory.mktemp("https") / "data"
    serve = ServeProcess.on_data_dir(
        data_dir, env={"TASKBOARD_HTTPS": "true", "FORWARDED_ALLOW_IPS": "127.0.0.1"}
    )
    password = re.search(r"admin\s+password (\S+)", serve.output)
    assert password, serve.output
    yield serve, password[1]
    serve.stop()


def cookie_header(response: httpx.Response, name: str) -> str:
    [header] = [h for h in response.headers.get_list("set-cookie") if h.startswith(f"{name}=")]
    return header


@pytest.mark.slow
def test_over_https_the_server_sends_hsts_a_csp_and_secure_cookies(
    https_serve: tuple[ServeProcess, str],
) -> None:
    serve, password = https_serve
    with httpx.Client(base_url=serve.url, headers=HTTPS) as client:
        form = client.get("/accounts/login/")
        assert form.status_code == 200
        assert form.headers["strict-transport-security"] == "max-age=31536000"
        policy = dict(
            directive.strip().split(" ", 1)
            for directive in form.headers["content-security-policy"].split(";")
        )
        assert policy["script-src"] == "'self'"
        assert policy["frame-ancestors"] == "'none'"
        assert "; secure" in cookie_header(form, "csrftoken").lower()

        # (httpx, like a browser, does not send a Secure cookie over http://: as the proxy
        # would, send it along.)
        csrf = client.cookies["csrftoken"]
        logged_in = client.post(
            "/accounts/login/",
            data={"username": "admin", "password": password, "csrfmiddlewaretoken": csrf},
            headers={
                "Cookie": f"csrftoken={csrf}",
                "Referer": f"https://127.0.0.1:{serve.port}/accounts/login/",
            },
        )
        assert logged_in.status_code == 302, logged_in.text
        assert "; secure" in cookie_header(logged_in, "sessionid").lower()


@pytest.mark.slow
def test_hsts_is_sent_only_when_the_proxy_says_the_request_came_over_tls(
    https_serve: tuple[ServeProcess, str],
) -> None:
    serve, _ = https_serve
    plain = httpx.get(f"{serve.url}/accounts/login/")
    assert "strict-transport-security" not in plain.headers
    assert "content-security-policy" in plain.headers


@pytest.mark.slow
@pytest.mark.django_db
def test_x_forwarded_proto_from_a_peer_that_is_not_a_named_proxy_is_not_believed(
    tmp_path: Path,
) -> None:
    from tests.processes import tests_database_url

    for proxies in ("", "192.0.2.1"):
        serve = ServeProcess(
            tmp_path / f"serve-{proxies}.log",
            "--workers",
            "1",
            env={
                "DATABASE_URL": tests_database_url(),
                "TASKBOARD_HTTPS": "true",
                "FORWARDED_ALLOW_IPS": proxies,
            },
        )
        try:
            serve.wait_healthy()
            claimed = httpx.get(f"{serve.url}/accounts/login/", headers=HTTPS)
        finally:
            serve.stop()
        assert claimed.status_code == 200
        assert "strict-transport-security" not in claimed.headers, proxies
        assert "content-security-policy" in claimed.headers


@pytest.mark.django_db
def test_without_taskboard_https_nothing_of_it_is_sent() -> None:
    response = Client().get("/accounts/login/", headers=HTTPS)
    assert response.status_code == 200
    assert "Strict-Transport-Security" not in response.headers
    assert "Content-Security-Policy" not in response.headers
    assert not response.cookies["csrftoken"]["secure"]


@pytest.mark.slow
@pytest.mark.once
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}")
def test_the_pages_and_the_api_docs_work_under_the_content_security_policy(
    https_serve: tuple[ServeProcess, str],
) -> None:
    from playwright.sync_api import expect, sync_playwright

    from tests.browser import CHROMIUM_ARGS

    serve, password = https_serve
    violations: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            context = browser.new_context(base_url=serve.url)
            context.set_default_timeout(10000)
            page = context.new_page()
            page.on(
                "console",
                lambda message: (
                    violations.append(message.text)
                    if "Content Security Policy" in message.text
                    else None
                ),
            )
            page.on("pageerror", lambda error: violations.append(str(error)))

            page.goto("/api/v1/docs/")
            expect(page.locator(".swagger-ui .opblock").first).to_be_visible()

            page.goto("/accounts/login/")
            page.get_by_label("Username").fill("admin")
            page.get_by_label("Password").fill(password)
            page.get_by_role("button", name="Log in").click()
            expect(page.locator(".live")).to_have_attribute("data-stream", "live")

            page.goto("/admin/")
            expect(page.locator("#site-name")).to_be_visible()
        finally:
            browser.close()

    assert violations == []
