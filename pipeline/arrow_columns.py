"""The Arrow conversions every record batch of the reader shares: timestamps both ways, and a
batch assembled to the exact schema Spark expects.

Apart because the marker, dead-letter and raw batch builders and the ``mapInArrow`` decoders
of Spark's connector all need them, and none of those should import another for a helper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]


def timestamp_column(millis: Sequence[int | None]) -> pa.Array:
    """Epoch milliseconds as the UTC microsecond timestamps Spark's ``TIMESTAMP`` maps to."""
    import pyarrow as pa  # noqa: PLC0415

    return pa.array(millis, pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC"))


def epoch_millis(column: pa.Array) -> list[int]:
    """Epoch milliseconds of an Arrow timestamp column (any unit)."""
    import pyarrow as pa  # noqa: PLC0415

    as_ms = column.cast(pa.timestamp("ms", tz="UTC")) if column.type.unit != "ms" else column
    millis: list[int] = as_ms.cast(pa.int64()).to_pylist()
    return millis


def record_batch(columns: dict[str, Any], schema: pa.Schema) -> pa.RecordBatch:
    """A batch of ``schema`` from ``columns`` by name: Arrow arrays cast where their type
    differs, Python lists converted to the field's type."""
    import pyarrow as pa  # noqa: PLC0415

    arrays = []
    for field in schema:
        value = columns[field.name]
        if isinstance(value, pa.Array):
            arrays.append(value.cast(field.type) if value.type != field.type else value)
        else:
            arrays.append(pa.array(value, type=field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
