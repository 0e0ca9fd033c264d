"""The web console in a real headless browser (Chromium through chromedriver), against a real
``kmq-tracker run`` process on the test broker with SQLite, and a real kmq consumer.

One workload, walked through as an operator would: log in, read the overview's counts (they
arrive by the page's own refresh), open a dead-lettered message (reason, history, payload),
redrive its dead letters after a dry run and watch the job finish, see the redriven messages
come back and get acknowledged by the consumer, inspect a parked malformed marker. Payloads,
keys, headers and reasons carry script and markup: the DOM must show them as text, and no
script may run. A read-only login sees no action and gets 403 when it posts anyway; no login
gets the login page.

Screenshots of every page are written to ``$KMQ_CONSOLE_SCREENSHOTS`` (``make
console-screenshots`` refreshes docs/console/), else to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait
from support.tracker_run import TrackerRun, ready

from tracker.client import KmqConsumer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TopicFactory = Callable[..., Awaitable[str]]
ADMIN = "console-admin-token-for-tests"
READER = "console-read-token-for-tests"
GROUP = "console-workers"
WAIT = 45.0  #: seconds a page may take to show what the test waits for

# Values from Kafka and consumers that must render as text.
XSS_VALUE = b'<script>window.__xss = "value"</script>'
XSS_KEY = b'"><img src=x onerror="window.__xss=\'key\'">'
XSS_HEADER = b"<script>window.__xss='header'</script>"
XSS_REASON = "<img src=x onerror=\"window.__xss='reason'\"> bad <b>order</b>"
PARKED_VALUE = b"\x00\x01not a marker <script>window.__xss='parked'</script>"


def _browser_paths() -> tuple[str, str]:
    chromium = os.environ.get("KMQ_CHROMIUM") or shutil.which("chromium")
    driver = os.environ.get("KMQ_CHROMEDRIVER") or shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail(
            "the console's browser tests need Chromium and chromedriver: run "
            "scripts/ensure-browser.sh (apt-get install chromium chromium-driver), or set "
            "KMQ_CHROMIUM and KMQ_CHROMEDRIVER"
        )
    return chromium, driver


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("KMQ_CONSOLE_SCREENSHOTS") or tmp_path / "screenshots")
    target.mkdir(parents=True, exist_ok=True)
    return target


@contextlib.contextmanager
def chromium() -> Iterator[WebDriver]:
    binary, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",  # the suite runs as root in CI
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--force-device-scale-factor=1",
        "--lang=en-US",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Console:
    """The browser, pointed at the tracker's console (blocking calls: run in a thread)."""

    def __init__(self, driver: WebDriver, base: str, shots: Path) -> None:
        self.driver = driver
        self.base = base
        self.shots = shots

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def wait(self, what: str, condition: Callable[[WebDriver], Any]) -> Any:
        try:
            # A section the page refreshes is replaced while the condition reads it: try again.
            return WebDriverWait(
                self.driver,
                WAIT,
                poll_frequency=0.2,
                ignored_exceptions=(StaleElementReferenceException,),
            ).until(condition)
        except TimeoutException:
            body = self.driver.find_element(By.TAG_NAME, "body").text
            raise AssertionError(
                f"the console never showed {what} within {WAIT:g} s; at "
                f"{self.driver.current_url}:\n{body[:3000]}"
            ) from None

    # Text is read in one script call: the page's own refreshes swap sections, and an element
    # found in one WebDriver call may be gone (stale) by the next.
    def text(self, css: str) -> str:
        found = self.driver.execute_script(
            "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;", css
        )
        assert found is not None, f"nothing matches {css} at {self.driver.current_url}"
        return str(found).strip()

    def texts(self, css: str) -> list[str]:
        found = self.driver.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText);", css
        )
        return [str(t).strip() for t in found]

    def reload_until(self, what: str, ready: Callable[[], bool]) -> None:
        """Reload the page until ``ready()``: for what a page reads from Kafka within
        ``api_kafka_read_timeout`` (payload, marker history), which a busy broker may miss
        once (the page then says so and shows the rest). A message's page loads those after
        it is shown: it is reloaded only once that part has come and is not ``ready()``."""

        def shown(driver: WebDriver) -> bool:
            if ready():
                return True
            if not driver.find_elements(By.CSS_SELECTOR, "[data-testid=kafka-pending]"):
                driver.refresh()
            return False

        self.wait(what, shown)

    def click(self, what: str, find: Callable[[WebDriver], Any]) -> None:
        """Click what ``find`` returns, finding it again if a refresh replaced it."""

        def clicked(driver: WebDriver) -> bool:
            find(driver).click()
            return True

        self.wait(f"{what} to click", clicked)

    def login(self, token: str) -> None:
        self.driver.find_element(By.NAME, "token").send_keys(token)
        self.driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
        self.wait("the page after logging in", lambda d: "/console/login" not in d.current_url)

    def shot(self, name: str) -> None:
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(1280, max(900, min(int(height) + 40, 4000)))
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))
        self.driver.set_window_size(1280, 900)

    def assert_no_script_ran(self) -> None:
        ran = self.driver.execute_script("return window.__xss === undefined ? null : window.__xss")
        assert ran is None, f"a value ran as script: {ran!r}"
        with contextlib.suppress(NoAlertPresentException):
            alert = self.driver.switch_to.alert
            raise AssertionError(f"a dialog opened: {alert.text!r}")
        injected = self.driver.find_elements(By.CSS_SELECTOR, "img[src='x'], main b")
        assert injected == [], "markup from a value became part of the page"

    def cell(self, topic: str, column: str) -> str:
        found = self.texts(f"tr[data-topic='{topic}'] td[data-col='{column}']")
        return found[0] if found else ""


class Workers:
    """A kmq consumer group member: acks ``ok-*``, rejects a message the first time it sees
    it when its value or key carries markup, acks every redelivered or redriven copy."""

    def __init__(self, bootstrap: str, topic: str, markers: str) -> None:
        self.bootstrap, self.topic, self.markers = bootstrap, topic, markers
        self.seen: Counter[bytes] = Counter()
        self.acked: Counter[bytes] = Counter()
        self.taken = 0

    async def run(self) -> None:
        async with KmqConsumer(
            self.topic,
            group_id=GROUP,
            bootstrap_servers=self.bootstrap,
            markers_topic=self.markers,
            processing_timeout=timedelta(minutes=10),
        ) as consumer:
            async for message in consumer:
                value = message.value or b""
                self.taken += 1
                self.seen[value] += 1
                if self.seen[value] > 1 or value.startswith(b"ok-"):
                    await message.ack()
                    self.acked[value] += 1
                elif value.startswith(b"<") or (message.key or b"").startswith(b'"'):
                    await message.reject(XSS_REASON)
                # else: left in flight (the lease is 10 minutes)
                await consumer.flush()


@contextlib.asynccontextmanager
async def workers_running(workers: Workers) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(workers.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(what: str, check: Callable[[], bool], within: float = WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.1)


async def test_an_operator_walks_through_the_console(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path, screenshots: Path
) -> None:
    _browser_paths()
    topic = await topic_factory(partitions=2, prefix="console-orders")
    run = TrackerRun(kafka_bootstrap, tmp_path)
    run.env.update({"KMQ_API_TOKEN": ADMIN, "KMQ_API_READ_TOKEN": READER})
    async with run:
        await run.wait_for_readiness("ready", ready)
        async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all") as producer:
            for i in range(3):
                await producer.send_and_wait(topic, f"ok-{i}".encode(), partition=0)
            for i in range(3):
                body = f'{{"order": {i}, "amount": {10 * i}}}'.encode()
                await producer.send_and_wait(topic, body, key=f"order-{i}".encode(), partition=1)
            await producer.send_and_wait(
                topic, XSS_VALUE, key=b"k", headers=[("note", XSS_HEADER)], partition=0
            )
            await producer.send_and_wait(topic, b"plain", key=XSS_KEY, partition=1)
            # A malformed marker: the tracker parks it.
            await producer.send_and_wait(run.markers, PARKED_VALUE, key=b"junk", partition=0)
        workers = Workers(kafka_bootstrap, topic, run.markers)
        async with workers_running(workers) as task:
            await until(
                "the consumer took all 8 messages", lambda: workers.taken >= 8 or task.done()
            )
            assert not task.done(), task
            base = f"http://127.0.0.1:{run.http_port}"
            with chromium() as driver:
                console = Console(driver, base, screenshots)
                await asyncio.to_thread(operator_as_admin, console, topic)
                # The redriven copies reach the consumer, which acks them.
                await until(
                    "the redriven messages acked",
                    lambda: workers.acked[XSS_VALUE] == 1 and workers.acked[b"plain"] == 1,
                )
                await asyncio.to_thread(redriven_messages_are_gone, console, topic)
                await asyncio.to_thread(parked_marker, console)
                await asyncio.to_thread(read_only_operator, console, topic)
                await asyncio.to_thread(logged_out, console)


def operator_as_admin(console: Console, topic: str) -> None:
    console.open("/console/")
    console.wait("the login page", lambda d: "/console/login" in d.current_url)
    console.shot("login")
    console.login(ADMIN)
    assert console.text("[data-testid=role]") == "admin"
    # The counts arrive by the overview's own refresh (every 5 s), without a reload.
    console.wait(
        "the workload's counts",
        lambda d: (
            console.cell(topic, "in_flight") == "3"
            and console.cell(topic, "dead_letters") == "2 / 2"
        ),
    )
    assert console.cell(topic, "delayed") == "0"
    console.wait("the chart", lambda d: d.find_elements(By.CSS_SELECTOR, ".chart .uplot"))
    console.assert_no_script_ran()
    console.shot("overview")

    console.click("the topic", lambda d: d.find_element(By.LINK_TEXT, topic))
    console.wait("the topic page", lambda d: console.texts("[data-testid=topic-name]") == [topic])
    assert len(console.texts("[data-testid=messages] tbody tr")) == 3
    console.shot("topic")

    console.open("/console/dlq")
    groups = console.texts("[data-testid=reason-groups] tbody tr")
    assert len(groups) == 1
    assert XSS_REASON in groups[0]
    assert "2" in groups[0]
    console.assert_no_script_ran()
    console.shot("dead-letters")

    # The dead letter of the message whose value is a script: reason, history, payload.
    links = console.driver.find_elements(By.CSS_SELECTOR, "[data-testid=dead-letters] td a")
    for link in links:
        if link.text.startswith(f"{topic}/0/"):
            link.click()
            break
    else:
        raise AssertionError("no dead letter from partition 0")
    console.wait(
        "the message page", lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=status]")
    )
    assert console.text("[data-testid=status]") == "dead lettered"
    assert console.text("[data-testid=dead-letter-reason]").endswith(f": {XSS_REASON}")
    console.reload_until(
        "the payload and the marker history",
        lambda: (
            bool(console.texts("[data-testid=value]"))
            and "rejected" in "".join(console.texts("[data-testid=history]"))
        ),
    )
    history = console.text("[data-testid=history]")
    for step in ("delivered (START)", "rejected", "dead-lettered"):
        assert step in history, history
    assert console.text("[data-testid=value]") == XSS_VALUE.decode()
    assert XSS_HEADER.decode() in console.text("[data-testid=headers]")
    console.assert_no_script_ran()
    console.shot("message")

    # Redrive: a dry run first, which shows what would move, then for real.
    console.open(f"/console/dlq?topic={topic}")
    form = console.driver.find_element(By.CSS_SELECTOR, "[data-testid=redrive-form]")
    Select(form.find_element(By.NAME, "topic")).select_by_value(topic)
    form.find_element(By.NAME, "why").send_keys("fixed the parser")
    assert form.find_element(By.NAME, "dry_run").is_selected()
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    console.wait(
        "the dry run", lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=job-state]")
    )
    assert console.text("[data-testid=job-state]") == "done"
    assert console.text("[data-testid=job-counts]") == "2"
    assert (
        len(console.driver.find_elements(By.CSS_SELECTOR, "[data-testid=would-move] tbody tr")) == 2
    )
    console.assert_no_script_ran()
    console.shot("redrive-dry-run")
    console.driver.find_element(By.CSS_SELECTOR, "[data-testid=run-for-real] button").click()
    console.wait("the real job's page", lambda d: "dry run" not in console.text("h1"))
    # The job page follows the job by itself until it is done.
    console.wait("the job done", lambda d: console.text("[data-testid=job-state]") == "done")
    assert console.text("[data-testid=job-counts]") == "2 of 2"
    console.shot("redrive-job")


def redriven_messages_are_gone(console: Console, topic: str) -> None:
    console.open("/console/")
    console.wait(
        "no dead letter waiting and the redriven copies acked",
        lambda d: (
            console.cell(topic, "dead_letters") == "0 / 2"
            and console.cell(topic, "in_flight") == "3"
        ),
    )
    console.open(f"/console/dlq?topic={topic}&redriven=yes")
    assert (
        len(console.driver.find_elements(By.CSS_SELECTOR, "[data-testid=dead-letters] tbody tr"))
        == 2
    )


def parked_marker(console: Console) -> None:
    console.open("/console/")
    console.wait("the parked count", lambda d: console.text("[data-testid=parked-count]") == "1")
    console.open("/console/parked")
    rows = console.driver.find_elements(By.CSS_SELECTOR, "[data-testid=parked] tbody tr")
    assert len(rows) == 1
    assert "malformed" in rows[0].text
    console.shot("parked")
    rows[0].find_element(By.TAG_NAME, "a").click()
    console.wait(
        "the parked record",
        lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=parked-value]"),
    )
    dump = console.text("[data-testid=parked-value]")
    assert dump.startswith("00000000  00 01 6e 6f 74")
    console.assert_no_script_ran()


def read_only_operator(console: Console, topic: str) -> None:
    console.driver.delete_all_cookies()
    console.open("/console/")
    console.wait("the login page", lambda d: "/console/login" in d.current_url)
    console.login(READER)
    assert console.text("[data-testid=role]") == "read-only"
    console.click("the topic", lambda d: d.find_element(By.LINK_TEXT, topic))
    console.wait("the topic page", lambda d: console.texts("[data-testid=topic-name]") == [topic])
    console.click(
        "a message", lambda d: d.find_element(By.CSS_SELECTOR, "[data-testid=messages] tbody td a")
    )
    console.wait(
        "a message page", lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=status]")
    )
    assert console.driver.find_elements(By.CSS_SELECTOR, "[data-testid=actions]") == []
    message_id = console.driver.current_url.split("/console/messages/", 1)[1]
    # Posting anyway, with this session's own form token: 403, and the message is untouched.
    status = console.driver.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const csrf = document.querySelector("input[name=csrf]").value;
        const body = new URLSearchParams({message_id: arguments[0], csrf: csrf});
        fetch("/console/actions/ack", {method: "POST", body: body}).then(r => done(r.status));
        """,
        message_id,
    )
    assert status == 403
    console.driver.refresh()
    assert console.text("[data-testid=status]") == "in flight"


def logged_out(console: Console) -> None:
    console.driver.find_element(By.CSS_SELECTOR, "header form button").click()
    console.wait("the login page", lambda d: "/console/login" in d.current_url)
    console.open("/console/dlq")
    console.wait("the login page again", lambda d: "/console/login" in d.current_url)
    assert console.driver.find_elements(By.NAME, "token")
