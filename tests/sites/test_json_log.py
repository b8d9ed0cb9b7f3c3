"""log_format json: one JSON object a line, with the run's context."""

from __future__ import annotations

import json
import logging

from p2pfl.sites.json_log import JsonFormatter, run_context


def _line(record_fn) -> dict:
    logger = logging.getLogger("p2pfl.test.json")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        record_fn(logger)
    finally:
        logger.removeHandler(handler)
    return json.loads(JsonFormatter().format(records[-1]))


def test_fields_and_context():
    with run_context(run_id="0123456789abcdef", node="s1"):
        line = _line(lambda log: log.warning("round %d done", 3, extra={"round": 3}))
    assert line["message"] == "round 3 done" and line["level"] == "WARNING"
    assert line["run_id"] == "0123456789abcdef" and line["node"] == "s1" and line["round"] == 3
    assert line["ts"].endswith("+00:00")
    outside = _line(lambda log: log.info("x", extra={"peer": object()}))
    assert "run_id" not in outside and isinstance(outside["peer"], str)


def test_a_traceback_travels_in_exc():
    def fail(log):
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed")

    assert "ValueError: bad" in _line(fail)["exc"]
