"""A question asked of a child process: its answer, or why there is none, and no child left."""

from __future__ import annotations

import asyncio
import os
import textwrap

import pytest

from p2pfl.child_answer import MAX_ANSWER, ask_child


def _module(tmp_path, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return name


def _ask(tmp_path, name: str, *args: str, timeout: float = 60.0):
    return asyncio.run(ask_child(name, list(args), timeout=timeout, cwd=tmp_path))


def test_the_answer_is_the_last_line_and_what_the_work_prints_is_not(tmp_path):
    name = _module(
        tmp_path,
        "asked",
        """
        import sys
        from p2pfl.child_answer import answer_main

        def work(argv):
            print("chatter from outside code")
            return {"echo": argv, "n": 3}

        sys.exit(answer_main(work, sys.argv[1:]))
        """,
    )
    reply = _ask(tmp_path, name, "x", "y")
    assert reply.problem is None
    assert reply.answer == {"echo": ["x", "y"], "n": 3}


def test_an_exception_in_the_work_is_an_answer_naming_it(tmp_path):
    name = _module(
        tmp_path,
        "raises",
        """
        import sys
        from p2pfl.child_answer import answer_main

        def work(argv):
            raise LookupError("no such column 'lable'")

        sys.exit(answer_main(work, sys.argv[1:]))
        """,
    )
    assert _ask(tmp_path, name).answer == {"problem": "LookupError: no such column 'lable'"}


def test_a_child_that_dies_gives_its_exit_and_the_last_line_of_its_stderr(tmp_path):
    name = _module(tmp_path, "dies", "import nothing_here_at_all\n")
    reply = _ask(tmp_path, name)
    assert reply.answer is None
    assert reply.problem.startswith("gave no answer (exit 1: ModuleNotFoundError"), reply.problem


def test_a_child_past_its_timeout_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    name = _module(
        tmp_path,
        "hangs",
        f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(600)
        """,
    )
    reply = _ask(tmp_path, name, timeout=3.0)
    assert reply.problem == "took longer than 3 s"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_flood_on_stdout_is_read_to_its_end_and_kept_bounded(tmp_path):
    name = _module(
        tmp_path,
        "floods",
        """
        import sys
        sys.stdout.write("x" * (4 << 20) + "\\n")
        sys.stdout.write('{"late": true}\\n')
        """,
    )
    reply = _ask(tmp_path, name)
    # the child never blocks on a full pipe; its answer, past the cap, is not read
    assert reply.answer is None and reply.problem == "gave no answer (exit 0)"
    assert MAX_ANSWER < 4 << 20
