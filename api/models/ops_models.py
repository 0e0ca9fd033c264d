"""Health and readiness."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
)


class Health(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"]


class Check(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"ok": True, "detail": "database answers"}]}
    )

    ok: bool
    detail: str


class Readiness(BaseModel):
    """Ready: the database and the broker answer, and (with the engine) partitions are owned."""

    ready: bool
    checks: dict[str, Check]

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "ready": True,
                    "checks": {
                        "store": {"ok": True, "detail": "database answers"},
                        "broker": {"ok": True, "detail": "Kafka answers"},
                        "partitions": {"ok": True, "detail": "owns markers partitions [0, 1]"},
                    },
                }
            ]
        }
    )
