"""What the admin API's models share: field types and patterns, the validators that keep
free text storable and JSON types strict, examples, and the error body (see the package's
docstring for the rules)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)
from pydantic_core import PydanticCustomError

MAX_PARTITION = 2**31 - 1
MAX_OFFSET = 2**63 - 1
TOPIC_PATTERN = r"^[a-zA-Z0-9._-]{1,249}$"
#: Any text without NUL (the pattern also tells the schema's consumers).
TEXT_PATTERN = r"^[^\x00]*$"
EXAMPLE_TIME = "2026-11-21T09:30:00Z"


def storable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


def example_of(model: type[BaseModel]) -> dict[str, Any]:
    """The first example of ``model`` (to compose the examples of the models that hold it)."""
    extra = model.model_config.get("json_schema_extra")
    assert isinstance(extra, dict)  # noqa: S101 - every model here has examples
    examples = extra["examples"]
    assert isinstance(examples, list)  # noqa: S101
    first = examples[0]
    assert isinstance(first, dict)  # noqa: S101
    return dict(first)


def text(max_length: int, description: str, *, min_length: int = 0) -> Any:
    """A free-text field: bounded, storable.

    Put it before ``AfterValidator(storable)`` in an ``Annotated``: constraints given after a
    validator are checked on its result as on any value ("at most 1000 items"), not as string
    constraints ("at most 1000 characters"), and the pattern drops out of the schema.
    """
    return Field(
        min_length=min_length, max_length=max_length, pattern=TEXT_PATTERN, description=description
    )


def _json_type(kind: Literal["int", "float", "bool"]) -> BeforeValidator:
    """Refuses a JSON string (or, for a number, a boolean) where a request body wants a number
    or a boolean: pydantic's lax mode would read ``"10"`` as 10 and ``"false"`` as False, and
    such a body is surely a client's mistake. Query parameters are strings on the wire and stay
    lax; a JSON number with a zero fraction (``10.0``) is still an integer."""
    wanted = "a JSON boolean (true or false)" if kind == "bool" else "a JSON number"
    refused: tuple[type, ...] = (str, bytes, bytearray) if kind == "bool" else (str, bytes, bool)

    def check(value: Any) -> Any:
        if isinstance(value, refused):
            raise PydanticCustomError(
                f"{kind}_type",
                "Input should be {wanted}, not {given}",
                {"wanted": wanted, "given": "a boolean" if isinstance(value, bool) else "a string"},
            )
        return value

    return BeforeValidator(check)


JsonInt = _json_type("int")
JsonFloat = _json_type("float")
JsonBool = _json_type("bool")


def _int64_text(value: Any) -> Any:
    """A Kafka position may come as a JSON string of digits: int64 offsets are strings in many
    JSON stacks (kafkajs' ``message.offset``, protobuf's JSON mapping), and the sidecar serves
    exactly those clients. Anything else that is not a JSON number is refused as by JsonInt."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return value


Reason = Annotated[str, text(1000, "Why (kept in the audit trail)."), AfterValidator(storable)]
TopicName = Annotated[str, Field(pattern=TOPIC_PATTERN, description="A Kafka topic name.")]
GroupId = Annotated[
    str,
    text(255, "A consumer group id.", min_length=1),
    AfterValidator(storable),
]
# Before-validators run last to first: digits become a number (_int64_text), then the JSON
# type is checked (JsonInt), then the constraints, which stay number constraints (in the
# schema too) because they come first.
Partition = Annotated[int, Field(ge=0, le=MAX_PARTITION), JsonInt, BeforeValidator(_int64_text)]
Offset = Annotated[int, Field(ge=0, le=MAX_OFFSET), JsonInt, BeforeValidator(_int64_text)]


class ErrorItem(BaseModel):
    """One invalid input."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "loc": ["query", "limit"],
                    "msg": "Input should be less than or equal to 1000",
                    "type": "less_than_equal",
                }
            ]
        }
    )

    loc: list[str | int] = Field(description="Where: e.g. ['query', 'limit'].")
    msg: str
    type: str


class ErrorResponse(BaseModel):
    """Every error: a short machine-readable code and a sentence for people."""

    error: str = Field(description="Error code, e.g. not_found, conflict, validation_error.")
    detail: str = Field(description="What went wrong and, where it helps, what to do.")
    errors: list[ErrorItem] | None = Field(
        None, description="For validation errors: each invalid input."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": "conflict",
                    "detail": "only an in-flight message's lease can be extended; this one is "
                    "delayed",
                    "errors": None,
                }
            ]
        }
    )
