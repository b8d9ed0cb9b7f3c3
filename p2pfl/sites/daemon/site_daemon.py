"""The site daemon (``p2pfl daemon --site site.yaml``): long-lived, in the foreground, one
per site. It joins its federation's broker, admits runs by the site's own policy and trains
each admitted run in a worker process (docs/design.md, "Site policy", "The site daemon").

:class:`SiteDaemon` is its lifecycle: it makes the one
:class:`~p2pfl.sites.daemon.context.SiteContext` its parts share, and the parts, each an
object of its own room: the agreement on runs
(:class:`~p2pfl.sites.consent.run_agreement.RunAgreement`), the workers' slots
(:class:`~p2pfl.sites.runs.slots.WorkerSlots`), the series
(:class:`~p2pfl.sites.runs.series.SeriesCycles`), the swarm's CRLs
(:class:`~p2pfl.sites.trust.crl_updates.TrustUpdates`), the operator's requests
(:class:`~p2pfl.sites.daemon.admin_commands.AdminCommands`), the bindings' watch and the
serving process; it runs them until drained or stopped, and says why it is not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from p2pfl.sites.consent.ledger import FINAL, LEDGER_FILE, ConsentLedger, RunEntry
from p2pfl.sites.consent.run_agreement import RunAgreement
from p2pfl.sites.daemon.admin_commands import AdminCommands
from p2pfl.sites.daemon.admin_socket import AdminServer
from p2pfl.sites.daemon.context import SiteContext
from p2pfl.sites.daemon.observe import ObservabilityServer, parse_listen
from p2pfl.sites.daemon.site_file import SiteFile
from p2pfl.sites.daemon.systemd import Notifier
from p2pfl.sites.policy.site_check import check_method_names
from p2pfl.sites.runs.processes import ServingProcess
from p2pfl.sites.runs.series import SeriesCycles
from p2pfl.sites.runs.slots import WorkerSlots
from p2pfl.sites.trust.crl_updates import TrustUpdates

log = logging.getLogger(__name__)


class SiteDaemon:
    """The daemon of ``site`` (a loaded site file) on ``broker`` (host:port; default the
    site file's). Run it with :meth:`run`: it returns 0 once drained, and stops (its
    workers too) when cancelled."""

    def __init__(self, site: SiteFile, *, broker: str | None = None):
        self.ctx = ctx = SiteContext(site, broker or site.broker_address)
        self.name = site.site
        self.series = SeriesCycles(ctx)
        self.trust = TrustUpdates(ctx)
        self.slots = WorkerSlots(ctx, self.series)
        self.agreement = RunAgreement(ctx, self.slots, self.series, self.trust)
        self.admin = AdminCommands(ctx, self.agreement, self.slots, self.trust, self.not_ready)
        self.notifier = Notifier()
        # the policy's own mistakes (a method name no run can give), said at start
        self.policy_problems = [
            f"{p.field}: {p.message}" for p in check_method_names(site).problems
        ]
        self.serving: ServingProcess | None = None
        if site.serving.listen is not None:
            if site.source is None:
                raise ValueError(f"site {site.site}: serving needs a site loaded from its file")
            self.serving = ServingProcess(
                site.source, ctx.state_dir / "serving.log", ctx.serving_metrics
            )

    async def run(self) -> int:
        """Serve until drained (0) or cancelled; workers still running are stopped."""
        ctx = self.ctx
        ctx.state_dir.mkdir(parents=True, exist_ok=True)
        ctx.ledger = ConsentLedger(ctx.state_dir / LEDGER_FILE)
        await ctx.bindings.start()
        reopened = self._recover()
        self.slots.prune()  # what a predecessor finished beyond limits.keep_runs
        for problem in self.policy_problems:
            log.warning("%s: site file %s: %s", self.name, ctx.site.source, problem)
        if ctx.identity is None:
            log.warning(
                "%s: no certs in the site file: specs, votes and commits travel unsigned "
                "and unsigned ones are taken (a trial on one machine only)",
                self.name,
            )
        http = None
        if ctx.site.observability.listen is not None:
            host, port = parse_listen(ctx.site.observability.listen)
            http = ObservabilityServer(host, port, ctx.metrics, self.not_ready)
        admin = AdminServer(ctx.state_dir, self.admin.handle)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(admin)
            if http is not None:
                await stack.enter_async_context(http)
            tasks = [
                asyncio.create_task(ctx.link.run(self.agreement.on_message)),
                asyncio.create_task(self._watchdog()),
                asyncio.create_task(self.series.ticks()),
                asyncio.create_task(self.series.watch_data()),
                asyncio.create_task(ctx.bindings.watch()),
                asyncio.create_task(self.agreement.end_lost_runs(reopened)),
            ]
            if self.serving is not None:
                tasks.append(asyncio.create_task(self.serving.run()))
            if ctx.site.limits.warm_worker is True:
                self.slots.warm_up()
            try:
                await ctx.link.connected.wait()
                self.notifier.ready(f"site {self.name}: connected to {ctx.broker}")
                log.info(
                    "%s: site daemon of swarm %s ready (broker %s, admin socket %s)",
                    self.name,
                    ctx.swarm,
                    ctx.broker,
                    admin.path,
                )
                await self.slots.drained.wait()
                return 0
            finally:
                self.notifier.stopping()
                await self.slots.stop_workers("the site daemon stopped")
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for st in ctx.runs.values():
                    for t in st.tasks:
                        t.cancel()
                ctx.ledger.close()

    def _recover(self) -> list[RunEntry]:
        """A run this site was training when its daemon stopped has lost its worker; the
        other open runs, returned, come back with their retained messages
        (:meth:`~p2pfl.sites.consent.run_agreement.RunAgreement.end_lost_runs`)."""
        assert self.ctx.ledger is not None
        reopened = []
        for entry in self.ctx.ledger.runs():
            if entry.status == "running":
                self.ctx.ledger.set_status(entry.run_id, "failed", "the site daemon stopped")
            elif entry.status not in FINAL:
                reopened.append(entry)
        self.ctx.count_runs()
        return reopened

    async def _watchdog(self) -> None:
        interval = self.notifier.watchdog_interval()
        while True:
            await asyncio.sleep(interval or 3600)
            if interval:
                self.notifier.watchdog()

    def not_ready(self) -> list[str]:
        """Why the daemon is not ready (``/readyz``): none when it is."""
        ctx = self.ctx
        why = []
        if not ctx.link.connected.is_set():
            why.append(f"broker {ctx.broker} not connected")
        if ctx.draining:
            why.append("draining")
        if self.serving is not None and self.serving.problem:
            why.append(self.serving.problem)
        if ctx.identity is not None:
            problem = ctx.identity.problem()
            if problem:
                why.append(f"certificate: {problem}")
        why += ctx.bindings.not_ready()  # a missing file, a label not in it, ...
        why += self.policy_problems
        return why


def install_signal_handlers(task: asyncio.Task) -> None:
    """SIGTERM and SIGINT stop the daemon (its workers too): systemd's stop, Ctrl-C."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
