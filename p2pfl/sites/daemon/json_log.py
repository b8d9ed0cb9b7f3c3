"""``observability.log_format: json``: one JSON object a line, for a log shipper to index.

Each line holds ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message`` and, when known,
``run_id``, ``round``, ``node`` and ``peer``: from the record's attributes (``extra=``) or
else from the context the code that logged runs in (:func:`run_context`, which asyncio
tasks created inside it inherit), and ``exc`` (the traceback) for an exception.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import math
import sys
from collections.abc import Iterator
from typing import Any

CONTEXT_FIELDS = ("run_id", "round", "node", "peer")
"""The fields a line carries when known, from ``extra=`` or :func:`run_context`."""

_context: dict[str, contextvars.ContextVar[Any]] = {
    name: contextvars.ContextVar(f"p2pfl_log_{name}", default=None) for name in CONTEXT_FIELDS
}


@contextlib.contextmanager
def run_context(**fields: Any) -> Iterator[None]:
    """Within the block, and in the asyncio tasks created in it, log lines carry ``fields``
    (of :data:`CONTEXT_FIELDS`; a field given None is unknown there). The fields of an
    enclosing block come back when it ends. Raises ``TypeError`` for another name."""
    unknown = sorted(set(fields) - set(CONTEXT_FIELDS))
    if unknown:
        raise TypeError(f"run_context takes {', '.join(CONTEXT_FIELDS)}, not {unknown[0]!r}")
    tokens = [(_context[k], _context[k].set(v)) for k, v in fields.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON (a message's line breaks escaped inside its string).

    A context field is the record's attribute of that name when it is set and not None
    (``extra=``), else the value :func:`run_context` gave it, else absent. A value that is
    not a JSON scalar (an object, a NaN) is written as its ``str``, so formatting a record
    never fails on what was logged.
    """

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is None:
                value = _context[name].get()
            if value is not None:
                line[name] = _scalar(value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line)


def _scalar(value: Any) -> str | int | float | bool:
    """``value`` when JSON writes it as a plain scalar, else its ``str``."""
    if isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return str(value)


def use_json_logs(level: int = logging.INFO) -> None:
    """Log JSON lines (:class:`JsonFormatter`) to stderr at ``level``: the root logger's
    handlers are replaced (and closed) by this one."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
