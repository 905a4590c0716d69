"""Data contracts of bdsgd. ``trace_v1`` is the run-time trace schema every reader and writer uses."""

from bdsgd.schemas.trace_v1 import (
    COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    VERSION_KEY,
    to_table,
    validate_schema,
    validate_table,
    validate_values,
)

__all__ = [
    "COLUMNS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "VERSION_KEY",
    "to_table",
    "validate_schema",
    "validate_table",
    "validate_values",
]
