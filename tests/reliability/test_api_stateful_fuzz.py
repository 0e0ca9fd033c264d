"""Stateful fuzzing of the admin API with schemathesis: sequences of calls, never a 5xx.

The stateless fuzz test (``tests/integration/test_api_fuzz.py``) sends every operation
generated requests one at a time. Bugs of an API with state hide in *sequences*: act on a
message found by a listing, then act on it again; create a redrive job, read it, cancel it,
cancel it again. schemathesis infers those links from the schema (the ids a response returns
and the path parameters that take them); its state machine then chains calls along them, with
the admin token, on the same served app and seeded data as the stateless test (SQLite and
PostgreSQL), with the same times as users write them for ``date-time`` inputs. Every answer must
be documented, never a server error, and match its schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyStrategyDefinition
from integration.api_support import ADMIN_TOKEN, bearer
from integration.test_api_fuzz import CHECKS, ServedApp, user_time_formats
from support.databases import sqlite_url

from .harness import size

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEQUENCES = size(25, 150)
STEPS = size(8, 15)
MIN_LINKS = 8  #: transitions inferred today; fewer means the inference broke
MAX_RESTARTS = 5


@pytest.fixture(params=["sqlite", "postgres"])
def served(
    request: pytest.FixtureRequest, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServedApp]:
    if request.param == "sqlite":
        url = sqlite_url(tmp_path_factory.mktemp("stateful") / "kmq.sqlite3")
    else:
        url = request.getfixturevalue("postgres_url")
    app = ServedApp(kafka_bootstrap, url)
    app.start()
    try:
        yield app
    finally:
        app.stop()


@pytest.fixture
def user_times() -> Iterator[None]:
    """``date-time`` inputs get times as users write them (naive, date-only, epoch...)."""
    with user_time_formats():
        yield


@pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies"
    ":hypothesis.errors.HypothesisDeprecationWarning"
)
@pytest.mark.usefixtures("user_times")
def test_call_sequences_never_get_a_server_error(served: ServedApp) -> None:
    schema = schemathesis.openapi.from_url(f"{served.base_url}/openapi.json")
    machine = schema.as_state_machine()
    links = [name for name in dir(machine) if "__" in name and not name.startswith(("_", "RANDOM"))]
    assert len(links) >= MIN_LINKS, f"only {len(links)} links inferred: {links}"
    calls: list[str] = []

    class Workflow(machine):  # type: ignore[misc,valid-type]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": bearer(ADMIN_TOKEN), "timeout": 30}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            calls.append(f"{case.method} {case.formatted_path} -> {response.status_code}")
            case.validate_response(response, checks=CHECKS, headers=bearer(ADMIN_TOKEN))

    # The sequences depend on the server's answers, and the server's state moves on: when
    # Hypothesis replays a prefix and draws differently (FlakyStrategyDefinition), that is
    # noise, not a finding (schemathesis' own runner restarts then too). A real failure is a
    # failed check (raised as is) or FlakyFailure (a failure that did not replay): not caught.
    restarts = 0
    while True:
        try:
            Workflow.run(
                settings=settings(
                    max_examples=SEQUENCES,
                    stateful_step_count=STEPS,
                    deadline=None,
                    database=None,
                    derandomize=restarts == 0,
                    phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
            )
            break
        except FlakyStrategyDefinition:
            restarts += 1
            if restarts > MAX_RESTARTS or len(calls) >= SEQUENCES * STEPS:
                break
    chained = [c for c in calls if "{" not in c]
    print(
        f"\n[api stateful fuzz] {len(calls)} calls in {SEQUENCES} sequences, {len(links)} links, "
        f"{restarts} restarts after a replay that drew differently"
    )
    assert len(chained) >= SEQUENCES, f"only {len(chained)} calls made"
