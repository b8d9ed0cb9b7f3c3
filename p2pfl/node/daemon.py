"""The node daemon: one node's lifecycle.

Lifecycle of :meth:`Node.run` (one asyncio task per node; several may share a process):

1. load the node's data shard (:mod:`p2pfl.learning.node_inputs`) and build its method
   once, the one that runs (:func:`~p2pfl.algorithms.build.node_method`, in a worker
   thread; whoever starts a node checked its inputs first: ``p2pfl node``, ``p2pfl swarm``,
   :func:`p2pfl.run_swarm`, with :mod:`p2pfl.check.checked`); restore
   the node's checkpoint when its run directory has one (:mod:`p2pfl.services.checkpoint`;
   ``fresh`` ignores it);
2. build its transport (:mod:`p2pfl.node.wiring`), its
   :class:`~p2pfl.services.bundle.NodeServices` and its round driver: the one of
   :data:`~p2pfl.rounds.driver.DRIVERS` that selects its method, which also says whom the
   node talks to and hears (:class:`~p2pfl.rounds.driver.RoundDriver`); the daemon never
   tests a method's kind;
3. ``await driver.start()`` (whom the startup barrier waits for), connect to the broker
   (retained presence + Last Will) and wait until those peers are present
   (``timing.startup_timeout_s`` at most);
4. ``await driver.run()``: every wait is bounded by ``timing.round_timeout_s``, so a silent
   or dead peer delays nobody past the deadline. Meanwhile the broker is watched: out of
   reach past ``timing.broker_timeout_s``, the rounds stop and the node fails
   (:class:`~p2pfl.wire.transport.BrokerLostError`), its completed rounds on disk;
5. announce ``done``, write the trained model, and keep serving pulls until every peer it
   hears is done or gone (``timing.linger_s`` at most), write any record a full disk held
   back, then leave.

The daemon routes the transport's callbacks to the driver, refuses the pulls of a refused
peer (a model layout unlike its own) or while the device is emulated offline, and tells the
driver when a neighbour comes online. A node whose broker is on the LAN announces itself by
mDNS for as long as it runs.

Training and evaluation run in worker threads: the event loop keeps answering peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p2pfl.algorithms import get_algorithm
from p2pfl.algorithms.base import Method
from p2pfl.algorithms.build import node_method, node_seed
from p2pfl.background import background
from p2pfl.config.privacy_schema import DPConfig
from p2pfl.config.schema import BrokerAddress, TopologyConfig, dump_topology
from p2pfl.errors import ConfigError, P2PFLError
from p2pfl.learning.artifacts import ExportError, write_model_artifacts
from p2pfl.learning.data import NodeData, load_node_data
from p2pfl.learning.layout import describe_layout
from p2pfl.learning.node_inputs import check_dataset, check_node_data
from p2pfl.learning.train import load_optimizer_machinery
from p2pfl.metrics import (
    node_log_path,
    node_meta_path,
    read_records,
    write_json,
    write_text_atomic,
)
from p2pfl.node.wiring import announce, build_transport, load_security
from p2pfl.rounds.driver import RoundDriver, driver_for
from p2pfl.services.bundle import NodeServices
from p2pfl.services.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from p2pfl.services.layout_requests import ask_layouts, on_layout_message
from p2pfl.services.optimizer_state import KeptOptimizer
from p2pfl.wire.loop import quiet_closed_socket_races
from p2pfl.wire.transport import BrokerLostError, Transport, TransportError

if TYPE_CHECKING:  # Opacus is imported only by a node that trains under privacy.dp
    from p2pfl.services.privacy import NodePrivacy
    from p2pfl.services.update_privacy import NodeUpdatePrivacy

log = logging.getLogger(__name__)


class RecordsLostError(P2PFLError, OSError):
    """Round records that could not be written to the run directory (a disk full to the end)."""


@dataclass
class NodeOptions:
    """What differs between devices running the same topology."""

    broker: BrokerAddress | None = None  # None: the topology's
    data_root: str | None = None
    device: str | None = None
    out_dir: Path | None = None
    cache_dir: str | None = None
    certs: str | None = None  # None: the topology's security.certs
    fresh: bool = False  # ignore a checkpoint in out_dir (start over instead of resuming)
    source: str = "topology"  # where the config came from, for error messages


class Node:
    """One node daemon: set-up, broker connection, the round driver of its method, and a
    clean leave. ``method_cls`` is the registered method class; ``method`` its instance
    for this node (built by :meth:`run`, with the data)."""

    def __init__(self, cfg: TopologyConfig, node_id: str, options: NodeOptions | None = None):
        if node_id not in cfg.node_ids:
            raise ValueError(f"node id {node_id!r} is not in topology {cfg.name!r}")
        self.cfg = cfg
        self.id = node_id
        self.opts = options or NodeOptions()
        self.broker = self.opts.broker or cfg.broker
        self.device = torch.device(self.opts.device or cfg.training.device)
        self.out_dir = Path(self.opts.out_dir) if self.opts.out_dir else None
        self.method_cls = get_algorithm(cfg.algorithm.name)
        self.driver_cls = driver_for(self.method_cls, cfg)  # its round protocol
        self.neighbours = self.driver_cls.peers_of(cfg, node_id)
        self.rng = np.random.default_rng(node_seed(cfg.seed, node_id))
        self.method: Method | None = None
        self.data: NodeData | None = None
        self.transport: Transport | None = None
        self.services: NodeServices | None = None
        self.driver: RoundDriver | None = None
        self.records: list[dict[str, Any]] = []
        self.resumed_round = 0  # the round of the checkpoint this node resumed from
        self._online: set[str] = set()  # peers whose latest presence is online
        self._security_ctx: tuple[Any, Any] | None = None  # see security_context()
        self.layout: dict[str, Any] | None = None  # describe_layout of the built model
        # privacy.dp: settings and accountant (DP-SGD's, or the update level's)
        self.privacy: NodePrivacy | NodeUpdatePrivacy | None = None
        # training.optimizer_state: keep: the optimizer kept across rounds (and resumes)
        self.optimizer: KeptOptimizer | None = None

    # ------------------------------------------------------------------ set-up
    def _load(self) -> None:
        """Data shard, model and method (blocking: run in a thread)."""
        data_root = self.opts.data_root or None
        ds = self.cfg.dataset.with_root(data_root)
        # inputs that cannot work fail here naming the file and the field, not a traceback
        source = self.opts.source
        if ds.own_data:  # partition: none: this node's own root, whole
            self.data = check_node_data(
                self.cfg, self.id, source=source, data_root=data_root, cache_dir=self.opts.cache_dir
            )
        else:
            check_dataset(ds, self.cfg.seed, source, self.opts.cache_dir)  # opens, or says why
            try:
                self.data = load_node_data(
                    ds, self.cfg.node_ids, self.id, self.cfg.seed, cache_dir=self.opts.cache_dir
                )
            except ValueError as exc:  # the dataset opened above: the partition cannot be drawn
                raise ConfigError(source, [("dataset.partition", str(exc))]) from None
        self.method = node_method(
            self.method_cls, self.cfg, self.id, self.data, self.rng, self.device, source
        )
        if self.cfg.dp is not None:  # σ planned once, before round 1
            self.privacy = self._plan_privacy(self.cfg.dp, len(self.data.train_y), source)
            log.info("%s: privacy.dp: %s", self.id, self.privacy.describe())
        if self.cfg.training.optimizer_state == "keep":
            self.optimizer = KeptOptimizer(self.method.model, self.cfg.training)
        self.layout = describe_layout(
            self.method.model.state_dict(), tuple(self.data.input_shape), self.data.num_classes
        )
        self.resumed_round = self._resume()

    def _plan_privacy(
        self, dp: DPConfig, n_samples: int, source: str
    ) -> NodePrivacy | NodeUpdatePrivacy:
        """The node's DP settings and accountant for ``privacy.dp``'s level; a
        :class:`ConfigError` naming the field when σ cannot be planned."""
        from p2pfl.privacy.errors import PrivacyError

        try:
            if dp.level == "update":
                from p2pfl.services.update_privacy import NodeUpdatePrivacy  # dp-accounting

                return NodeUpdatePrivacy.plan(self.cfg, self.id)
            from p2pfl.services.privacy import NodePrivacy  # Opacus: only under privacy.dp

            return NodePrivacy.plan(self.cfg, self.id, n_samples)
        except PrivacyError as exc:
            raise ConfigError(source, [(exc.field, exc.reason)]) from None

    def _resume(self) -> int:
        """Restore this node's checkpoint from the run directory, if it has one (``fresh``
        removes it and the node's records instead); returns the round to go on after: the
        checkpoint's, or the last recorded one when the node died between writing a round's
        record and its checkpoint (that round is not run twice). 0: starting fresh."""
        if self.out_dir is None:
            return 0
        path = checkpoint_path(self.out_dir, self.id)
        records = node_log_path(self.out_dir, self.id)
        if self.opts.fresh:
            path.unlink(missing_ok=True)
            records.unlink(missing_ok=True)
            return 0
        rounds = (r.get("round") for r in read_records(records))
        recorded = max((r for r in rounds if isinstance(r, int)), default=0)
        ckpt = load_checkpoint(path)
        if ckpt is None:
            return recorded
        ckpt.check_for(self.cfg, self.id, str(path))
        assert self.method is not None
        ckpt.restore(self.method, self.rng, str(path))
        try:
            if self.privacy is not None:
                self.privacy.load_state(ckpt.privacy, str(path))
            if self.optimizer is not None:
                self.optimizer.load_state(ckpt.optimizer, str(path))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        log.warning("%s: resuming from the checkpoint of round %d (%s)", self.id, ckpt.round, path)
        return max(ckpt.round, recorded)

    def _write_run_files(self) -> None:
        """This node's data facts, and the resolved config if nobody recorded it yet."""
        if self.out_dir is None or self.data is None:
            return
        config_path = self.out_dir / "config.yaml"
        if not config_path.exists():  # daemons started by hand: the first one records it
            resolved = self.cfg.model_copy(update={"broker": self.broker})
            write_text_atomic(config_path, dump_topology(resolved))
        write_json(
            node_meta_path(self.out_dir, self.id),
            {
                "node": self.id,
                "neighbours": self.neighbours,
                "n_train": len(self.data.train_y),
                "n_test": len(self.data.test_y),
                "train_hist": self.data.train_hist,
                "test_hist": self.data.test_hist,
                "data_source": self.data.source,  # the file or directory this node read
                "classes": self.data.classes,
                "input_spec": self.data.input_spec,
                "started": time.time(),
            },
        )

    def security_context(self) -> tuple[Any, Any]:
        """(message security, TLS context) from ``security`` and this device's certs dir
        (``--certs`` / its node config, else ``security.certs``); built once (loading keys
        and checking certificates), so a caller may check it early and :meth:`run` reuses
        it."""
        if self._security_ctx is None:
            self._security_ctx = load_security(self.cfg, self.id, self.certs_dir, self.opts.source)
        return self._security_ctx

    @property
    def certs_dir(self) -> str | None:
        """This device's certificate directory: ``--certs`` / its node config, else
        ``security.certs``."""
        return self.opts.certs or self.cfg.security.certs

    def _connect(self) -> Transport:
        """The node's transport (not connected yet), its services and its round driver,
        wired together."""
        assert self.method is not None and self.data is not None
        transport = build_transport(
            self.cfg,
            self.id,
            self.broker,
            layout=self.layout,
            security=self.security_context(),
            certs=self.certs_dir,
            listen_to=self.driver_cls.listens_to(self.neighbours),
        )
        self.services = NodeServices(
            cfg=self.cfg,
            node_id=self.id,
            neighbours=self.neighbours,
            method=self.method,
            data=self.data,
            transport=transport,
            rng=self.rng,
            device=self.device,
            out_dir=self.out_dir,
            records=self.records,
            privacy=self.privacy,
            resumed_round=self.resumed_round,
            optimizer=self.optimizer,
        )
        driver = self.driver = self.driver_cls(self.services)
        transport.on_presence = self._on_presence
        transport.on_gossip = driver.on_gossip
        transport.on_inbox = self._on_inbox
        transport.on_request = self._serve_pull
        return transport

    async def _serve_pull(self, env: Any) -> None:
        """A pull goes to the round driver unless its sender is refused (a layout unlike
        this node's): no weight moves to a node that could not use it."""
        assert self.services is not None and self.driver is not None
        why = self.services.peers.refusal(env.sender)
        if why is not None:
            await self.services.exchange.refuse_pull(env, f"refused: {why}"[:300])
            return
        if self.services.device.off_network:  # an emulated offline window: as if unreachable
            await self.services.exchange.refuse_pull(env, "offline")
            return
        await self.driver.serve_pull(env)

    # ------------------------------------------------------------------ peers
    def _on_inbox(self, env: Any) -> None:
        """A peer's ``layout_req`` or ``layout`` is the refused-peer gate's
        (:mod:`p2pfl.services.layout_requests`); every other inbox message goes to the round
        driver."""
        assert self.services is not None and self.driver is not None
        if not on_layout_message(self.services, env, self.layout, self.neighbours):
            self.driver.on_inbox(env)

    def _on_presence(self, peer: str, info: dict[str, Any]) -> None:
        online = info.get("status") == "online"
        assert self.services is not None and self.driver is not None
        peers = self.services.peers
        if online and peer in self.neighbours and self.layout is not None:
            online = peers.check_layout(peer, info, self.layout)  # refused: never a peer
            ask_layouts(self.services)  # a tensor list names the first difference
        if online and peer not in self._online and peer in self.neighbours:
            self.driver.on_peer_online(peer)  # a neighbour (re)joined
        if online:
            self._online.add(peer)
        else:
            self._online.discard(peer)
        peers.notify()

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> list[dict[str, Any]]:
        """Run the whole lifecycle; returns the per-round records."""
        async with contextlib.AsyncExitStack() as stack:
            return await self._run(stack)

    async def _run(self, stack: contextlib.AsyncExitStack) -> list[dict[str, Any]]:
        t_start = time.monotonic()
        self.security_context()  # a missing or bad certificate fails before loading
        await asyncio.to_thread(self._load)
        cfg = self.cfg
        if self.broker.mdns:  # browse for a broker announced for this swarm
            from p2pfl.wire.discovery import find_broker  # zeroconf only for nodes that use it

            self.broker = await find_broker(cfg.name, cfg.timing.startup_timeout_s)
            log.info("%s: broker %s found by mDNS", self.id, self.broker)
        self._write_run_files()
        self.transport = self._connect()
        svc, driver = self.services, self.driver
        assert svc is not None and driver is not None
        awaited = await driver.start()  # whom the startup barrier waits for
        async with self.transport:
            await announce(stack, cfg, self.id, self.broker, self.transport)
            present = await svc.peers.wait_for(
                lambda: all(svc.peers.status(p) in ("online", "done", "refused") for p in awaited),
                time.monotonic() + cfg.timing.startup_timeout_s,
            )
            if not present:
                absent = [p for p in awaited if svc.peers.status(p) not in ("online", "done")]
                log.warning("%s: starting without neighbours %s", self.id, absent)
            log.info(
                "%s: ready after %.1f s; neighbours %s",
                self.id,
                time.monotonic() - t_start,
                self.neighbours,
            )
            # ready when its peers are (a spread start would leave it out of round 1's
            # roster), then off round 1's training clock, while the event loop serves
            await asyncio.to_thread(load_optimizer_machinery)
            svc.device.emulated.start_clock()
            await self._drive(driver)
            try:
                await self.transport.set_status("done", round=cfg.rounds)
            except TransportError as exc:
                log.warning("%s: could not announce done: %s", self.id, exc)
            await self._write_model()  # the trained model, for p2pfl export/predict
            # linger while a peer it hears may still pull from it (of a peer it no longer
            # hears, a centralized member's view is stale: that peer needs nothing from it)
            transport = self.transport
            await svc.peers.wait_for(
                lambda: all(
                    svc.peers.status(p) != "online"
                    for p in self.neighbours
                    if transport.hears_presence(p)
                ),
                time.monotonic() + cfg.timing.linger_s,
            )
            await svc.aclose()  # the best-effort publishes still in flight
        await self._flush_records()
        return self.records

    async def _write_model(self) -> None:
        """Write the trained model beside the records (``nodes/<id>.safetensors`` and
        ``nodes/<id>.model.json``, :mod:`p2pfl.learning.artifacts`), in a worker thread; a
        disk that refuses is logged, never fatal."""
        if self.out_dir is None or self.method is None or self.data is None:
            return
        data, model = self.data, self.method.model
        last = self.records[-1]["round"] if self.records else self.resumed_round
        info = {
            "model": self.cfg.model.applicable(),  # only what shapes this model
            "algorithm": self.cfg.algorithm.name,
            "num_classes": data.num_classes,
            "input_shape": list(data.input_shape),
            "classes": data.classes or None,  # []: not known
            "input_spec": data.input_spec or None,
            "round": last,
        }
        try:
            await asyncio.to_thread(
                write_model_artifacts, self.out_dir, self.id, model.export_module(), info
            )
        except (OSError, ExportError) as exc:
            log.warning("%s: trained model not written: %s", self.id, exc)

    async def _drive(self, driver: RoundDriver) -> None:
        """Run the rounds while watching the broker: when it stays out of reach past
        ``timing.broker_timeout_s``, stop the rounds and fail the node
        (:class:`~p2pfl.wire.transport.BrokerLostError`), keeping what is on disk. Both
        tasks live only as long as this call; a failure of the rounds is raised."""
        assert self.transport is not None
        async with background(driver.run()) as rounds:
            async with background(self._broker_lost()) as watch:
                await asyncio.wait({rounds, watch}, return_when=asyncio.FIRST_COMPLETED)
                lost = watch.result() if watch.done() else None
        if lost is not None:
            await self._flush_records()
            last = self.records[-1]["round"] if self.records else self.resumed_round
            raise BrokerLostError(f"{lost} after round {last}")

    async def _broker_lost(self) -> BrokerLostError:
        """Returns once the broker has been out of reach past ``timing.broker_timeout_s``."""
        assert self.transport is not None
        try:
            await self.transport.watch_broker()
        except BrokerLostError as exc:
            return exc
        raise AssertionError("watch_broker returned")  # it returns never

    async def _flush_records(self, timeout: float = 60.0) -> None:
        """Write the records a full disk held back, retrying for ``timeout`` seconds at
        most; what still cannot be written is reported (the node fails)."""
        rlog = self.services.ledger.record_log if self.services else None
        if rlog is None or rlog.flush():
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if rlog.flush():
                return
        raise RecordsLostError(
            f"{self.id}: {len(rlog.pending)} round record(s) could not be written to "
            f"{rlog.path} within {timeout:.0f} s"
        )


async def run_nodes(cfg: TopologyConfig, node_ids: list[str], options: NodeOptions) -> int:
    """Host several nodes in this process (same wire, same broker); returns how many failed."""
    return await run_all([Node(cfg, nid, options) for nid in node_ids])


async def run_all(nodes: list[Node]) -> int:
    """Run ``nodes`` together in this process; returns how many failed."""
    quiet_closed_socket_races(asyncio.get_running_loop())
    results = await asyncio.gather(*(n.run() for n in nodes), return_exceptions=True)
    failed = 0
    for node, res in zip(nodes, results, strict=True):
        if isinstance(res, P2PFLError):  # an input, the broker, the disk: a message
            failed += 1
            log.error("%s failed: %s", node.id, res)
            log.debug("%s: traceback", node.id, exc_info=res)
        elif isinstance(res, BaseException):
            failed += 1
            log.error("%s failed: %s", node.id, res, exc_info=res)
    return failed
