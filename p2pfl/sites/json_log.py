"""``observability.log_format: json``: one JSON object a line, with ``run_id``, ``round``,
``node`` and ``peer`` when known (from the record's ``extra``, else from the context a
daemon task runs in, :func:`run_context`)."""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

CONTEXT_FIELDS = ("run_id", "round", "node", "peer")
_context: dict[str, contextvars.ContextVar[Any]] = {
    name: contextvars.ContextVar(f"p2pfl_log_{name}", default=None) for name in CONTEXT_FIELDS
}


@contextlib.contextmanager
def run_context(**fields: Any) -> Iterator[None]:
    """Within the block (and in the tasks created in it), log lines carry ``fields``."""
    tokens = [(_context[k], _context[k].set(v)) for k, v in fields.items() if k in _context]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class JsonFormatter(logging.Formatter):
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
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def use_json_logs(level: int = logging.INFO) -> None:
    """Log JSON lines to stderr (every handler of the root logger replaced)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
