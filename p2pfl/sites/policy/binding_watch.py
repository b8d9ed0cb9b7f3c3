"""A site daemon's watch over its own data bindings (docs/design.md, "The site daemon").

:class:`BindingWatch` keeps the latest check of each binding
(:func:`~p2pfl.sites.policy.binding_check.check_binding`, run in a short-lived child process so the
daemon never imports pandas or holds a table), checks a binding again when its files or
the site file change (looked at every :data:`WATCH_S`, one stat each) and before every vote
on a run naming it (:meth:`BindingWatch.refresh`), gives the problems to the vote and to
``/readyz``, and logs a problem once a minute at most (:class:`LogLimit`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable

from p2pfl.child_answer import ask_child
from p2pfl.errors import ConfigError
from p2pfl.sites.daemon.site_file import SiteBinding, SiteFile
from p2pfl.sites.policy.binding_check import (
    BindingCheck,
    Problem,
    binding_mark,
    check_from_answer,
    path_mark,
)

log = logging.getLogger("p2pfl.sites.daemon")

WATCH_S = 2.0
"""How often the daemon looks at its bindings' files and its site file (a stat each)."""

LOG_EVERY_S = 60.0
"""A binding's unchanged problem is logged again at most this often."""

CHECK_TIMEOUT_S = 300.0
"""How long a binding's check may take (a large table is read in chunks)."""


class LogLimit:
    """Each message is logged at most once every ``every_s`` under its key; a message that
    differs from the key's last one is logged at once."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._last: dict[Hashable, tuple[str, float]] = {}

    def allows(self, key: Hashable, message: str) -> bool:
        """Whether to log ``message`` under ``key`` now (then it counts as logged)."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and last[0] == message and now - last[1] < self.every_s:
            return False
        self._last[key] = (message, now)
        return True

    def forget(self, key: Hashable) -> None:
        self._last.pop(key, None)


async def check_in_child(name: str, binding: SiteBinding, site: str) -> BindingCheck:
    """:func:`~p2pfl.sites.policy.binding_check.check_binding` in a child process
    (:func:`~p2pfl.child_answer.ask_child`); a child that fails or runs past
    :data:`CHECK_TIMEOUT_S` is the binding's problem."""
    args = [site, name, binding.model_dump_json()]
    reply = await ask_child("p2pfl.sites.policy.binding_check", args, timeout=CHECK_TIMEOUT_S)
    answer = reply.answer or {"problem": reply.problem}
    try:
        return check_from_answer(name, answer)
    except (ValueError, KeyError, TypeError):
        return BindingCheck(
            name, (Problem("root", f"checking it failed: {answer.get('problem')}"),)
        )


class BindingWatch:
    """The checks of ``site``'s bindings (``site.data`` is replaced when the site file's
    bindings change): :meth:`start` checks each one, :meth:`watch` keeps them current."""

    def __init__(self, site: SiteFile):
        self.site = site
        self._checks: dict[str, tuple[tuple, BindingCheck]] = {}
        self._log = LogLimit()
        self._site_mark = path_mark(site.source)
        self._site_problem = ""  # the site file, changed since the start, does not load

    async def start(self) -> None:
        """Check every binding (the daemon's start), logging each problem."""
        for name in list(self.site.data):
            await self.refresh(name)

    def problems(self, *names: str) -> dict[str, str]:
        """Binding → why it cannot serve a run (``data.<binding>.<field>: message``), for
        ``names`` (none given: every binding), as of their latest check; bindings that can
        serve a run, or not checked yet, are left out."""
        out = {}
        for name in names or tuple(self.site.data):
            held = self._checks.get(name)
            if name in self.site.data and held is not None and not held[1].ok:
                out[name] = held[1].text()
        return out

    def not_ready(self) -> list[str]:
        """The bindings' problems as of their latest check, and the site file's (``/readyz``)."""
        why = [self._site_problem] if self._site_problem else []
        return why + list(self.problems().values())

    async def refresh(self, name: str) -> None:
        """Check binding ``name`` again when its files changed since its last check."""
        binding = self.site.data.get(name)
        if binding is None:
            return
        mark = await asyncio.to_thread(binding_mark, binding, self.site.site)
        held = self._checks.get(name)
        if held is not None and held[0] == mark:
            return
        check = await check_in_child(name, binding, self.site.site)
        if self.site.data.get(name) is binding:  # not replaced meanwhile
            self._took(name, mark, check)

    def _took(self, name: str, mark: tuple, check: BindingCheck) -> None:
        before = self._checks.get(name)
        self._checks[name] = (mark, check)
        if not check.ok:
            if self._log.allows(name, check.text()):
                log.warning(
                    "%s: data binding %s cannot serve a run: %s", self.site.site, name, check.text()
                )
        elif before is not None and not before[1].ok:
            self._log.forget(name)
            log.info(
                "%s: data binding %s can serve runs again: %s", self.site.site, name, check.summary
            )

    async def watch(self) -> None:
        """Check a binding again when its files change, and take the site file's bindings
        when it changes (looked at every :data:`WATCH_S`)."""
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                self._reload_site_file()
                for name in list(self.site.data):
                    await self.refresh(name)
            except Exception:  # the watch goes on: the vote checks again by itself
                log.exception("%s: data bindings: not looked at", self.site.site)

    def _reload_site_file(self) -> None:
        """When the site file changed: take its ``data:`` bindings (checked again by the
        watch); a change elsewhere in it applies at the daemon's next start, which the log
        says; a file that no longer loads keeps the bindings the daemon has, and says why
        in ``/readyz``."""
        source = self.site.source
        if source is None:
            return
        mark = path_mark(source)
        if mark == self._site_mark:
            return
        self._site_mark = mark
        from p2pfl.sites.daemon.site_file import load_site

        name = self.site.site
        try:
            new = load_site(source)
        except (ConfigError, OSError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._site_problem = f"site file {source} changed and does not load: {first}"
            log.warning("%s: %s (the daemon goes on with what it loaded)", name, self._site_problem)
            return
        self._site_problem = ""
        if new.data != self.site.data:
            changed = sorted(
                n
                for n in set(new.data) | set(self.site.data)
                if new.data.get(n) != self.site.data.get(n)
            )
            self.site.data = new.data
            for binding in changed:  # a changed binding's mark differs: the watch checks it
                self._log.forget(binding)
                if binding not in new.data:
                    self._checks.pop(binding, None)
            log.info(
                "%s: site file %s: data bindings changed (%s): taken, checked again",
                name,
                source,
                ", ".join(changed),
            )
        others = [
            f
            for f in SiteFile.model_fields
            if f != "data" and getattr(new, f) != getattr(self.site, f)
        ]
        if others:
            log.warning(
                "%s: site file %s: changes to %s apply when the daemon starts again",
                name,
                source,
                ", ".join(others),
            )
