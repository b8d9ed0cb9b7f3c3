"""Outside code checked in a short-lived child process, never in the caller.

A run may name code from outside p2pfl: a ``package.module:Class`` method or model, or a
method an installed plugin declares. A site's daemon must judge such a run without
importing it (docs/design.md, "Site policy"): where the site's policy allows plugins,
:func:`probe_outside_code` runs ``python -m p2pfl.algorithms.cards.probe`` in a child
process, which imports the method (torch with it) and the model, and answers with the
method's card as its class declares it (kind, shares, knobs filled in) or why it is not a
method. The child ends with the answer; the caller's process imports nothing.

The child answers as :mod:`p2pfl.child_answer` has children answer (one JSON line, bounded;
what outside code prints goes to stderr); a child that runs past ``timeout`` is killed, and
either is an answer with ``problem`` set.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.child_answer import answer_main, ask_child

PROBE_TIMEOUT_S = 120.0
"""How long the child may take: it imports torch, on a machine that may be busy."""


@dataclass(frozen=True)
class OutsideCode:
    """What the child learned of a run's outside code: the method's ``kind`` and
    ``shares`` as its class declares them, or the ``problem`` (why the method or the model
    cannot be loaded, or the knobs are wrong)."""

    kind: str | None = None
    shares: frozenset[str] | None = None
    problem: str | None = None


async def probe_outside_code(
    method: str,
    params: dict[str, Any],
    model: str,
    *,
    cwd: Path | None = None,
    timeout: float = PROBE_TIMEOUT_S,
) -> OutsideCode:
    """Check ``method`` (its knobs ``params``) and ``model`` in a child process (``cwd``:
    where it runs and imports a module from); the caller imports neither."""
    request = json.dumps({"method": method, "params": params, "model": model})
    reply = await ask_child("p2pfl.algorithms.cards.probe", [request], timeout=timeout, cwd=cwd)
    answer = reply.answer
    if answer is None:
        return OutsideCode(problem=f"checking {method!r} {reply.problem}")
    if answer.get("problem"):
        return OutsideCode(problem=str(answer["problem"])[:500])
    shares = answer.get("shares")
    if not isinstance(shares, list) or not all(isinstance(s, str) for s in shares):
        return OutsideCode(problem=f"checking {method!r}: no shares in the answer")
    return OutsideCode(kind=str(answer.get("kind")), shares=frozenset(shares))


def _check(argv: list[str]) -> dict[str, Any]:
    """In the child: import the method and the model, and say what the method declares."""
    from p2pfl.algorithms import get_algorithm, validate_params
    from p2pfl.learning.user_code import UserCodeError, import_object

    request = json.loads(argv[0])
    if not isinstance(request, dict):
        return {"problem": "bad request"}
    method = str(request.get("method"))
    try:
        cls = get_algorithm(method)
        validate_params(method, request.get("params") or {})
    except ValueError as exc:
        return {"problem": str(exc)}
    model = str(request.get("model"))
    if ":" in model:
        try:
            import_object(model, "model")  # callable, or UserCodeError
        except UserCodeError as exc:
            return {"problem": f"model {model!r}: {exc}"}
    return {"kind": cls.kind, "shares": sorted(cls.shares)}


def main(argv: list[str]) -> int:
    """``python -m p2pfl.algorithms.cards.probe REQUEST_JSON``: one JSON answer line."""
    return answer_main(_check, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
