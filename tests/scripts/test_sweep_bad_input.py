"""scripts/sweep_bad_input.py: its cases cover the three commands, and its classifier tells
a clean error from a vague one, an accepted bad input, and a pass of a control (run on the
real command line)."""

from __future__ import annotations


def test_the_sweep_covers_validate_swarm_and_node(load_script, tmp_path):
    sweep = load_script("sweep_bad_input")
    cases = sweep.make_cases(sweep.Workspace(tmp_path))
    bad = [c for c in cases if not c.control]
    by = {cmd: sum(c.command == cmd for c in bad) for cmd in ("validate", "swarm", "node")}
    assert len(bad) >= 40 and min(by.values()) >= 10, by
    assert len({c.name for c in cases}) == len(cases)  # each case named once
    for c in bad:  # each names what a clean error must say
        assert c.expect, c.name


def test_the_classifier_on_real_commands(load_script, tmp_path):
    sweep = load_script("sweep_bad_input")
    ws = sweep.Workspace(tmp_path)
    good = ws.topology("good")
    binary = ws.raw("bin.yaml", bytes(range(128, 256)))
    cases = {
        "control": sweep.Case("control", ["validate", good], ["ok"], control=True),
        "clean": sweep.Case("clean", ["validate", binary], [binary, "not a text file"]),
        # the same error, but a case that expects a field it does not name
        "vague": sweep.Case("vague", ["validate", binary], [binary, "dataset.root"]),
        # valid input run as if it were bad: accepted
        "zero-exit": sweep.Case("zero", ["validate", good, "--no-data"], [good]),
    }
    for outcome, case in cases.items():
        result = sweep.run_case(case, ws, timeout=300)
        expected = "control-ok" if outcome == "control" else outcome
        assert result.outcome == expected, (outcome, result)
