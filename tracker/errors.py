"""Domain errors of kmq-tracker.

Every error has a docstring that doubles as its default message, so ``raise Foo()`` is already
informative and ``raise Foo("detail")`` adds the specifics. Callers catch :class:`KmqError` to
handle anything this package raises on purpose; any other exception is a bug.
"""

from __future__ import annotations


class KmqError(Exception):
    """An error raised by kmq-tracker."""

    #: the first line of the class docstring (computed once per class, not per error)
    default_message: str = "An error raised by kmq-tracker."

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.default_message = (cls.__doc__ or cls.__name__).strip().splitlines()[0]

    def __init__(self, message: str | None = None) -> None:
        text = message or self.default_message
        super().__init__(text)
        self.message: str = text


class MarkerError(KmqError, ValueError):
    """The marker is malformed: it does not follow the marker protocol."""


class InvalidHeader(KmqError, ValueError):
    """A kmq header on a Kafka record has an invalid value."""


class InvalidDelay(KmqError, ValueError):
    """The requested delay or delivery time is invalid."""


class AlreadySettled(KmqError):
    """The message was already settled (acked, retried or rejected) by this consumer."""


class ClientClosed(KmqError):
    """The client is not running: start it (or use it as an async context manager) first."""


class MarkerWriteFailed(KmqError):
    """The broker did not acknowledge the markers; the messages were not handed over."""
