"""log_format json: one JSON object a line, with the run's context."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import logging

import pytest

from p2pfl.sites.daemon.json_log import JsonFormatter, run_context, use_json_logs


def _line(record_fn) -> dict:
    """The JSON object :class:`JsonFormatter` makes of the last record ``record_fn`` logs."""
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
        logger.setLevel(logging.NOTSET)
    text = JsonFormatter().format(records[-1])
    assert "\n" not in text
    return json.loads(text)


@pytest.fixture
def json_stderr(capsys):
    """What :func:`use_json_logs` writes (its handler takes ``sys.stderr`` when installed:
    capsys's while the test runs), the root logger restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield lambda: capsys.readouterr().err
    root.handlers[:] = handlers
    root.setLevel(level)


def test_fields_and_context():
    with run_context(run_id="0123456789abcdef", node="s1"):
        line = _line(lambda log: log.warning("round %d done", 3, extra={"round": 3}))
    assert line["message"] == "round 3 done" and line["level"] == "WARNING"
    assert line["logger"] == "p2pfl.test.json"
    assert line["run_id"] == "0123456789abcdef" and line["node"] == "s1" and line["round"] == 3
    ts = dt.datetime.fromisoformat(line["ts"])
    assert ts.utcoffset() == dt.timedelta(0)
    assert abs((dt.datetime.now(dt.timezone.utc) - ts).total_seconds()) < 60
    outside = _line(lambda log: log.info("x"))
    assert not {"run_id", "round", "node", "peer", "exc"} & set(outside)


def test_extra_overrides_the_context():
    with run_context(run_id="r1", node="s1", peer="s2"):
        line = _line(lambda log: log.info("x", extra={"node": "s9", "peer": None}))
    assert line["node"] == "s9" and line["run_id"] == "r1"
    assert line["peer"] == "s2"  # None in extra: unknown there, so the context's


def test_contexts_nest_and_reach_tasks():
    async def in_a_task() -> dict:
        return _line(lambda log: log.info("from a task"))

    async def main() -> tuple[dict, dict, dict]:
        with run_context(run_id="r1", node="s1"):
            with run_context(round=4, run_id="r2"):
                inner = await asyncio.create_task(in_a_task())
            after = _line(lambda log: log.info("after"))
        return inner, after, _line(lambda log: log.info("outside"))

    inner, after, outside = asyncio.run(main())
    assert (inner["run_id"], inner["node"], inner["round"]) == ("r2", "s1", 4)
    assert (after["run_id"], after["node"]) == ("r1", "s1") and "round" not in after
    assert "run_id" not in outside and "node" not in outside


def test_only_the_known_fields_are_taken():
    with pytest.raises(TypeError), run_context(run="r1"):
        pass


def test_values_json_cannot_hold_become_strings():
    class Peer:
        def __str__(self) -> str:
            return "peer s2"

    line = _line(lambda log: log.info("x", extra={"peer": Peer(), "round": float("nan")}))
    assert line["peer"] == "peer s2" and line["round"] == "nan"


def test_a_traceback_travels_in_exc():
    def fail(log):
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed")

    line = _line(fail)
    assert "ValueError: bad" in line["exc"] and line["level"] == "ERROR"


def test_use_json_logs_writes_one_object_a_line(json_stderr):
    root = logging.getLogger()
    root.addHandler(logging.StreamHandler(io.StringIO()))  # replaced, like every other
    use_json_logs(logging.DEBUG)
    assert len(root.handlers) == 1 and root.level == logging.DEBUG
    log = logging.getLogger("p2pfl.test.json_root")
    with run_context(run_id="r1", node="s1"):
        log.debug("two\nlines")
        try:
            {}["missing"]
        except KeyError:
            log.exception("lookup failed")
    log.warning("plain", extra={"peer": "s3"})
    lines = json_stderr().splitlines()
    assert len(lines) == 3
    objects = [json.loads(line) for line in lines]
    assert [o["message"] for o in objects] == ["two\nlines", "lookup failed", "plain"]
    assert [o["level"] for o in objects] == ["DEBUG", "ERROR", "WARNING"]
    assert all(o["logger"] == "p2pfl.test.json_root" and "ts" in o for o in objects)
    assert objects[0]["run_id"] == "r1" and "KeyError" in objects[1]["exc"]
    assert objects[2]["peer"] == "s3" and "run_id" not in objects[2]


def test_use_json_logs_drops_what_is_below_its_level(json_stderr):
    use_json_logs(logging.INFO)
    logging.getLogger("p2pfl.test.json_root").debug("hidden")
    logging.getLogger("p2pfl.test.json_root").info("shown")
    assert [json.loads(x)["message"] for x in json_stderr().splitlines()] == ["shown"]
