"""``p2pfl validate --site site.yaml``: a site's own file checked as its daemon will use it,
before the site consents to any run (docs/design.md, "The site daemon").

The file loads (:func:`~p2pfl.sites.daemon.site_file.load_site`: its schema, its paths, its policy
file), then every checker of :data:`SITE_CHECKS` looks at it and says what it found: the
problems, each naming the site file's field (``data.<binding>.<field>``), and a line for
each thing that is fine. A checker is a function of the loaded site; a further one is
appended to :data:`SITE_CHECKS`.

Contract: torch-free, as the daemon is (:mod:`p2pfl.sites.policy.binding_check`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from p2pfl.algorithms.cards import check_method_name
from p2pfl.sites.daemon.site_file import SiteFile
from p2pfl.sites.policy.binding_check import check_binding


@dataclass(frozen=True)
class SiteProblem:
    """A problem of a site file: its ``field`` (dotted, as the file writes it) and what is
    wrong."""

    field: str
    message: str


@dataclass
class SiteReport:
    """What the checkers found: ``problems`` (none: the site file is fine) and ``lines``
    (what each thing checked holds, for the operator)."""

    problems: list[SiteProblem] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


SiteChecker = Callable[[SiteFile], SiteReport]


def check_bindings(site: SiteFile) -> SiteReport:
    """Every data binding checked as the daemon checks it before a vote
    (:func:`~p2pfl.sites.policy.binding_check.check_binding`)."""
    report = SiteReport()
    for name, binding in site.data.items():
        check = check_binding(name, binding, site.site)
        report.problems += [SiteProblem(check.where(p), p.message) for p in check.problems]
        if check.ok:
            report.lines.append(f"data.{name}: {check.summary}")
    return report


def check_method_names(site: SiteFile) -> SiteReport:
    """Every method the policy names (``methods.allow``, ``data.<binding>.methods``) is one
    a run can name: built-in, an installed plugin's, or a ``package.module:Class`` path (by
    the methods' cards: nothing is imported); else the known names, with "did you mean"."""
    report = SiteReport()
    named = [("policy.methods.allow", site.policy.methods.allow)]
    for binding, rule in (site.policy.data or {}).items():
        named.append((f"policy.data.{binding}.methods", rule.methods))
    for where, names in named:
        for name in [] if names == "any" else names:
            try:
                check_method_name(name)
            except ValueError as exc:
                report.problems.append(SiteProblem(where, str(exc)))
    return report


SITE_CHECKS: list[SiteChecker] = [check_bindings, check_method_names]
"""The checks ``p2pfl validate --site`` runs, in order; every one runs, whatever the others
found."""


def check_site(site: SiteFile, checks: Sequence[SiteChecker] | None = None) -> SiteReport:
    """What every checker of ``checks`` (default :data:`SITE_CHECKS`) found in ``site``."""
    out = SiteReport()
    for checker in SITE_CHECKS if checks is None else checks:
        found = checker(site)
        out.problems += found.problems
        out.lines += found.lines
    return out


__all__ = [
    "SITE_CHECKS",
    "SiteChecker",
    "SiteProblem",
    "SiteReport",
    "check_bindings",
    "check_method_names",
    "check_site",
]
