#!/usr/bin/env python
"""The path of a site's decision on one proposed spec (docs/architecture.md, "The site
wing"): the p2pfl files and function calls it enters once warm, how often it enters the
method registry, the first decision's time (what it imports) and a later one's, and
whether torch was imported. One copy measures either layout of the wing (``PYTHONPATH=<a
checkout>``): the spec validated, then judged (``policy/verdict.judge``), or, before the
wing was in rooms, ``run_facts`` and ``decide``.

    python scripts/decision_path.py
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

SPEC = {
    "name": "t",
    "rounds": 2,
    "algorithm": {"name": "uapdfl", "params": {"mu": 0.1}},
    "data": "syn",
}
REGISTRY_CALLS = ("get_algorithm", "validate_params", "method_source", "_load_all")


def decision() -> Any:
    """One decision on :data:`SPEC`, proposed by site ``a`` to a site holding binding
    ``syn`` under the default policy."""
    try:
        from p2pfl.sites.consent.run_spec import spec_from_dict
        from p2pfl.sites.policy.rules import Policy
        from p2pfl.sites.policy.verdict import judge
    except ImportError:  # before the wing was in rooms
        from p2pfl.sites.run_spec import run_facts, spec_from_dict

        from p2pfl.sites.policy import Policy, decide

        return decide(run_facts(spec_from_dict(SPEC, "x"), "a"), Policy(), bindings={"syn"})
    return judge(spec_from_dict(SPEC, "x"), "a", Policy(), {"syn"})


def main() -> int:
    t0 = time.perf_counter()
    decision()  # the first one imports what it needs
    first = time.perf_counter() - t0
    files: set[str] = set()
    calls = registry = 0

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's hook
        nonlocal calls, registry
        if event != "call" or "/p2pfl/" not in frame.f_code.co_filename:
            return
        rel = frame.f_code.co_filename.split("/p2pfl/", 1)[1]
        files.add(rel)
        calls += 1
        if rel.startswith("algorithms/") and frame.f_code.co_name in REGISTRY_CALLS:
            registry += 1

    sys.setprofile(tracer)
    decision()
    sys.setprofile(None)
    t0 = time.perf_counter()
    decision()
    later = time.perf_counter() - t0
    answer = {
        "files": sorted(files),
        "n_files": len(files),
        "function_calls": calls,
        "registry_calls": registry,
        "first_decision_s": round(first, 3),
        "later_decision_ms": round(later * 1000, 2),
        "torch_imported": "torch" in sys.modules,
    }
    print(json.dumps(answer, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
