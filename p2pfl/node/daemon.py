"""The node daemon: lifecycle, round loop, and the node's own communication queues.

Lifecycle of :meth:`Node.run` (one asyncio task per node; several may share a process):

1. load the node's data shard and build its model (in a worker thread);
2. connect to the broker (:class:`~p2pfl.wire.transport.Transport`, retained presence + Last Will);
3. wait until its topology neighbours are present (``timing.startup_timeout_s`` at most);
4. run ``rounds`` rounds of the decentralized protocol described in
   :mod:`p2pfl.algorithms.base`; every wait is bounded by ``timing.round_timeout_s``, so a
   silent or dead peer delays nobody past the deadline — the node goes on with the peers
   that answered and records who was missing;
5. announce ``done`` and keep serving pulls until every neighbour is done or gone
   (``timing.linger_s`` at most), then leave.

The peer set of every round is the node's topology neighbours that are present (retained
MQTT presence, ``online``). A neighbour that starts late is picked up in the next round
(its neighbours send their round's gossip again when it comes online); a node that itself
starts when its neighbours are already under way joins at the round after the latest one
they report (their presence carries it). A node whose broker is on the LAN (found with
``broker: mdns`` or given) announces itself by mDNS (:mod:`p2pfl.wire.discovery`) for as long as
it runs. With ``security.sign`` / ``security.tls`` it signs every message and connects with
its certificate (:mod:`p2pfl.security.signing`).

Training and evaluation run in worker threads: the event loop keeps answering peers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl import PROTOCOL_VERSION
from p2pfl.algorithms import AlgorithmContext, get_algorithm
from p2pfl.algorithms.base import Algorithm, CentralizedAlgorithm, Method
from p2pfl.config.load import ConfigError, dump_topology
from p2pfl.config.schema import BrokerAddress, TopologyConfig
from p2pfl.config.topology import neighbours
from p2pfl.learning.data import NodeData, load_node_data
from p2pfl.learning.models import SplitModel, build_model
from p2pfl.learning.state import PARTS, State
from p2pfl.learning.train import evaluate, round_lr, train_local
from p2pfl.metrics import (
    append_record,
    node_log_path,
    node_meta_path,
    write_json,
    write_text_atomic,
)
from p2pfl.node.centralized import CentralizedRounds
from p2pfl.wire.transport import Envelope, PreparedState, Transport, TransportError

log = logging.getLogger(__name__)

_MODEL_INIT_LOCK = threading.Lock()  # torch's global RNG is shared by co-hosted nodes
# packing a state for peers must not queue behind co-hosted nodes' training jobs
_PACK_POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="p2pfl-pack")
SNAPSHOTS_KEPT = 3
GOSSIP_AHEAD = 5  # rounds ahead of ours whose gossip we keep


def node_seed(seed: int, node_id: str) -> list[int]:
    """A per-node seed sequence that is stable across processes (no ``hash()``)."""
    return [seed, zlib.crc32(node_id.encode())]


def build_method(
    cls: type[Method],
    cfg: TopologyConfig,
    node_id: str,
    data: NodeData,
    rng: np.random.Generator,
    device: torch.device,
) -> Method:
    """Node ``node_id``'s method instance over the swarm's common initial model (torch's RNG
    seeded with ``cfg.seed``, under a lock shared by co-hosted nodes), on ``device``, told
    its epochs, the run's rounds and its training labels."""
    with _MODEL_INIT_LOCK:  # the same initial model on every node of the swarm
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, data.num_classes, data.input_shape)
        params = cls.Params.model_validate(cfg.algorithm.params)
        model = cls.adapt_model(model, params, data.num_classes)
    model.to(device)
    ctx = AlgorithmContext(
        node_id=node_id,
        model=model,
        num_samples=len(data.train_y),
        num_classes=data.num_classes,
        input_shape=tuple(data.input_shape),
        rng=rng,
        device=device,
    )
    method = cls(cfg.algorithm.params, ctx)
    method.local_epochs = cfg.training.epochs
    method.total_rounds = cfg.rounds  # e.g. DisPFL's annealing horizon
    method.set_labels(data.train_y)
    return method


@dataclass
class NodeOptions:
    """What differs between devices running the same topology."""

    broker: BrokerAddress | None = None  # None: the topology's
    data_root: str | None = None
    device: str | None = None
    out_dir: Path | None = None
    cache_dir: str | None = None
    certs: str | None = None  # None: the topology's security.certs


class Node:
    def __init__(self, cfg: TopologyConfig, node_id: str, options: NodeOptions | None = None):
        if node_id not in cfg.node_ids:
            raise ValueError(f"node id {node_id!r} is not in topology {cfg.name!r}")
        self.cfg = cfg
        self.id = node_id
        self.opts = options or NodeOptions()
        self.broker = self.opts.broker or cfg.broker
        self.device = torch.device(self.opts.device or cfg.training.device)
        self.out_dir = Path(self.opts.out_dir) if self.opts.out_dir else None
        self.method = get_algorithm(cfg.algorithm.name)
        if self.method.kind == "centralized":  # every member talks to the elected aggregator
            self.neighbours = [n for n in cfg.node_ids if n != node_id]
        else:
            self.neighbours = neighbours(cfg, node_id)
        self.rng = np.random.default_rng(node_seed(cfg.seed, node_id))
        self.round = 0
        self.transport: Transport | None = None
        self.algorithm: Method | None = None
        self.model: SplitModel | None = None
        self.data: NodeData | None = None
        self._snapshots: OrderedDict[int, State] = OrderedDict()
        self._prepared: dict[tuple[int, str], PreparedState] = {}
        self._prepare_locks: dict[tuple[int, str], asyncio.Lock] = {}
        self._gossip: dict[int, dict[str, dict[str, Any]]] = {}
        self._changed = asyncio.Event()
        self.records: list[dict[str, Any]] = []
        self.central: CentralizedRounds | None = None  # the aggregator driver, when centralized
        self._online: set[str] = set()  # peers whose latest presence is online
        self._last_gossip: tuple[int, dict[str, Any]] | None = None  # for late joiners
        self._started = False  # rounds under way: gossip is kept for a window around ours
        self._background: set[asyncio.Task] = set()
        self._security_ctx: tuple[Any, Any] | None = None  # see security_context()

    # ------------------------------------------------------------------ set-up
    def _load(self) -> None:
        """Data shard, model and algorithm (blocking: run in a thread)."""
        ds = self.cfg.dataset
        if self.opts.data_root:
            ds = ds.model_copy(update={"root": self.opts.data_root})
        self.data = load_node_data(
            ds, self.cfg.node_ids, self.id, self.cfg.seed, cache_dir=self.opts.cache_dir
        )
        self.algorithm = build_method(
            self.method, self.cfg, self.id, self.data, self.rng, self.device
        )
        self.model = self.algorithm.model

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
                "started": time.time(),
            },
        )

    # ------------------------------------------------------------------ peers
    def _status(self, peer: str) -> str:
        assert self.transport is not None
        return str(self.transport.peers.get(peer, {}).get("status", "unknown"))

    def _live_neighbours(self) -> list[str]:
        return [p for p in self.neighbours if self._status(p) == "online"]

    def _on_presence(self, peer: str, info: dict[str, Any]) -> None:
        online = info.get("status") == "online"
        if online and peer not in self._online and peer in self.neighbours:
            self._regossip()  # a neighbour (re)joined: it missed this round's gossip
        if online:
            self._online.add(peer)
        else:
            self._online.discard(peer)
        self._changed.set()

    def _regossip(self) -> None:
        """Publish this round's gossip again, for a neighbour that joined after it went out."""
        if self._last_gossip is None or self.transport is None:
            return
        round_no, message = self._last_gossip
        task = asyncio.ensure_future(self.transport.gossip(round_no, message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # best effort

    def _swarm_round(self) -> int:
        """The latest round an online neighbour reports having finished (0: none)."""
        assert self.transport is not None
        rounds = [self.transport.peers.get(p, {}).get("round") for p in self._live_neighbours()]
        return max((r for r in rounds if isinstance(r, int) and not isinstance(r, bool)), default=0)

    def security_context(self):
        """(message security, TLS context) from ``security`` and this device's certs dir;
        built once (loading keys and checking certificates), so a caller may check it early
        and :meth:`run` reuses it."""
        if self._security_ctx is None:
            self._security_ctx = self._load_security()
        return self._security_ctx

    def _load_security(self):
        sec = self.cfg.security
        if not sec.enabled:
            return None, None
        certs = self.opts.certs or sec.certs
        if not certs:
            raise ConfigError(
                "topology",
                [
                    (
                        "security.certs",
                        "security.tls/sign need the swarm's certificate directory "
                        "(security.certs, certs: in the node config, or --certs)",
                    )
                ],
            )
        from p2pfl.security.signing import MessageSecurity, tls_context

        signing = (
            MessageSecurity.from_certs(certs, self.id, self.cfg.node_ids, sec.max_age_s)
            if sec.sign
            else None
        )
        return signing, (tls_context(certs, self.id) if sec.tls else None)

    async def _announce(self, stack: contextlib.AsyncExitStack) -> None:
        """Announce this node by mDNS (``p2pfl discover``) for as long as it runs, when it
        talks to a broker on the LAN; nodes of a local swarm (loopback broker) do not."""
        from p2pfl.wire.discovery import Announcer, local_address

        address = local_address(self.broker.host, self.broker.port)
        if address.startswith("127."):
            return
        try:
            await stack.enter_async_context(
                Announcer.node(self.id, self.cfg.name, self.cfg.algorithm.name, address)
            )
        except (OSError, ValueError) as exc:  # discovery is a convenience: never fatal
            log.warning("%s: not announced by mDNS: %s", self.id, exc)

    def _on_gossip(self, env: Envelope) -> None:
        if env.kind != "gossip" or env.sender not in self.neighbours:
            return  # gossip is for neighbours; others' traffic is not ours to keep
        # before the first round, the round we join at is not known yet: keep any round
        lo, hi = (
            (self.round - 1, self.round + GOSSIP_AHEAD) if self._started else (1, self.cfg.rounds)
        )
        if not lo <= env.round <= hi:
            assert self.transport is not None
            self.transport.dropped["stale_gossip"] += 1
            return
        self._gossip.setdefault(env.round, {})[env.sender] = env.body
        self._changed.set()

    async def _wait_for(self, predicate, deadline: float) -> bool:
        """Wait until ``predicate()`` holds or the monotonic ``deadline`` passes."""
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    # ------------------------------------------------------------------ serving pulls
    async def _prepared_part(self, round_no: int, part: str) -> PreparedState | None:
        key = (round_no, part)
        if key in self._prepared:
            return self._prepared[key]
        lock = self._prepare_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._prepared:
                snap = self._snapshots.get(round_no)
                if snap is None:
                    return None
                assert self.algorithm is not None
                state = self.algorithm.select(snap, part)
                self._prepared[key] = await asyncio.get_running_loop().run_in_executor(
                    _PACK_POOL, PreparedState.from_state, state
                )
        return self._prepared.get(key)

    async def _serve_pull(self, env: Envelope) -> None:
        """Answer a neighbour's pull from the snapshot of the round it names."""
        assert self.transport is not None
        body = env.body if isinstance(env.body, dict) else {}
        part = body.get("part")
        reason = None
        if env.sender not in self.neighbours:
            reason = "not a neighbour"
        elif part not in PARTS:
            reason = f"unknown part {part!r}"
        prepared = None if reason else await self._prepared_part(env.round, part)
        if reason is None and prepared is None:
            reason = f"no state for round {env.round}"
        if reason is not None:
            self.transport.dropped["refused_pull"] += 1
            await self.transport.send(
                env.sender, "pull_error", env.round, {"xfer": env.id, "reason": reason}
            )
            return
        await self.transport.send_state(env.sender, env.id, env.round, prepared)

    def _keep_snapshot(self, round_no: int, state: State) -> None:
        self._snapshots[round_no] = state
        while len(self._snapshots) > SNAPSHOTS_KEPT:
            old, _ = self._snapshots.popitem(last=False)
            for part in PARTS:
                self._prepared.pop((old, part), None)
                self._prepare_locks.pop((old, part), None)

    # ------------------------------------------------------------------ the round
    async def _pull_all(
        self, plan: dict[str, str], deadline: float
    ) -> tuple[dict[str, State], dict[str, str]]:
        assert self.transport is not None
        timeout = max(0.1, deadline - time.monotonic())

        async def one(peer: str, part: str):
            return await self.transport.pull(peer, self.round, part, timeout)

        peers = sorted(plan)
        results = await asyncio.gather(*(one(p, plan[p]) for p in peers), return_exceptions=True)
        pulled, failed = {}, {}
        for peer, res in zip(peers, results, strict=True):
            if isinstance(res, BaseException):
                failed[peer] = str(res)
                log.warning("%s: round %d: %s", self.id, self.round, res)
            else:
                pulled[peer] = res
        return pulled, failed

    async def _train(self, round_no: int):
        assert self.algorithm and self.model and self.data
        alg, cfg = self.algorithm, self.cfg
        lr = round_lr(cfg.training, round_no)
        result = await asyncio.to_thread(
            train_local,
            self.model,
            self.data.train_x,
            self.data.train_y,
            cfg.training,
            lr,
            extra_loss=alg.extra_loss(),
            loss_fn=alg.loss_fn(),
            step_hook=alg.step_hook(),
            seed=int(self.rng.integers(2**31)),
            device=self.device,
        )
        if not math.isfinite(result.loss):
            log.warning(
                "%s: round %d: training loss is %s (lr %.4g too high? see the method's knobs)",
                self.id,
                round_no,
                result.loss,
                lr,
            )
        after = await asyncio.to_thread(alg.after_train)
        return result, lr, after or {}

    async def _run_round(self, round_no: int) -> dict[str, Any]:
        assert self.transport and self.algorithm and self.model and self.data
        alg, tr, cfg = self.algorithm, self.transport, self.cfg
        assert isinstance(alg, Algorithm)
        t0 = time.monotonic()
        sent0, recv0 = tr.stats.bytes_sent, tr.stats.bytes_recv
        self.round = round_no
        for old in [r for r in self._gossip if r < round_no - 1]:
            del self._gossip[old]
        result = lr = None
        after: dict[str, Any] = {}
        if alg.exchange_after_training:  # peers pull what this node just trained
            result, lr, after = await self._train(round_no)
        t_comm = time.monotonic()
        self._keep_snapshot(round_no, alg.snapshot())
        message = alg.gossip()
        chosen: list[str] = []
        if message is not None:
            self._last_gossip = (round_no, message)
            try:
                await tr.gossip(round_no, message)
            except TransportError as exc:  # broker gone: peers will not hear from us
                log.warning("%s: round %d: gossip not sent: %s", self.id, round_no, exc)
            chosen = alg.choose_peers(self._live_neighbours())
        deadline = t_comm + cfg.timing.round_timeout_s

        def heard_all() -> bool:
            got = self._gossip.get(round_no, {})
            return all(p in got or self._status(p) != "online" for p in chosen)

        await self._wait_for(heard_all, deadline)
        got = {p: self._gossip[round_no][p] for p in chosen if p in self._gossip.get(round_no, {})}
        plan, facts = alg.plan(got)
        pulled, failed = await self._pull_all(plan, deadline)
        comm_s = time.monotonic() - t_comm
        merged = await asyncio.to_thread(alg.merge, got, pulled)
        if not alg.exchange_after_training:
            result, lr, after = await self._train(round_no)
        assert result is not None and lr is not None
        acc, test_loss = await asyncio.to_thread(
            evaluate, self.model, self.data.test_x, self.data.test_y, 500, self.device
        )
        record = {
            "round": round_no,
            "test_acc": acc,
            "test_loss": test_loss,
            "train_loss": result.loss,
            "train_ce": result.ce_loss,
            "train_s": round(result.seconds, 4),
            "comm_s": round(comm_s, 4),
            "round_s": round(time.monotonic() - t0, 4),
            "bytes_sent": tr.stats.bytes_sent - sent0,
            "bytes_recv": tr.stats.bytes_recv - recv0,
            "lr": lr,
            "chosen": chosen,
            "peers": sorted(got),
            "missing": sorted(set(chosen) - set(got)),
            "pulled": {p: plan[p] for p in sorted(pulled)},
            "pull_failed": failed,
            "dropout": False,  # UA-PDFL's client-wise dropout; its facts say when it is taken
            **facts,
            **merged,
            **after,
            "dropped_total": sum(tr.dropped.values()),
            "t": time.time(),
        }
        return record

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> list[dict[str, Any]]:
        """Run the whole lifecycle; returns the per-round records."""
        async with contextlib.AsyncExitStack() as stack:
            return await self._run(stack)

    async def _run(self, stack: contextlib.AsyncExitStack) -> list[dict[str, Any]]:
        t_start = time.monotonic()
        signing, tls = self.security_context()  # a missing or bad certificate fails before loading
        await asyncio.to_thread(self._load)
        cfg = self.cfg
        if self.broker.mdns:  # browse for a broker announced for this swarm
            from p2pfl.wire.discovery import find_broker  # zeroconf only for nodes that use it

            self.broker = await find_broker(cfg.name, cfg.timing.startup_timeout_s)
            log.info("%s: broker %s found by mDNS", self.id, self.broker)
        await self._announce(stack)
        self._write_run_files()
        self.transport = Transport(
            cfg.name,
            self.id,
            self.broker.host,
            self.broker.port,
            presence={
                "node": self.id,
                "swarm": cfg.name,
                "algorithm": cfg.algorithm.name,
                "protocol": PROTOCOL_VERSION,
            },
            max_message_bytes=int(cfg.max_message_mb * 2**20),
            max_transfer_bytes=int(cfg.max_transfer_mb * 2**20),
            security=signing,
            tls_context=tls,
        )
        self.transport.on_presence = self._on_presence
        central = None
        if isinstance(self.algorithm, CentralizedAlgorithm):
            central = self.central = CentralizedRounds(self)
            self.transport.on_gossip = central.on_gossip
            self.transport.on_inbox = central.on_inbox
            self.transport.on_request = central.serve_pull
        else:
            self.transport.on_gossip = self._on_gossip
            self.transport.on_request = self._serve_pull
        async with self.transport:
            present = await self._wait_for(
                lambda: all(self._status(p) in ("online", "done") for p in self.neighbours),
                time.monotonic() + cfg.timing.startup_timeout_s,
            )
            if not present:
                absent = [p for p in self.neighbours if self._status(p) not in ("online", "done")]
                log.warning("%s: starting without neighbours %s", self.id, absent)
            log.info(
                "%s: ready after %.1f s; neighbours %s",
                self.id,
                time.monotonic() - t_start,
                self.neighbours,
            )
            if central is not None:
                await central.run()
            first = 1 if central is not None else self._swarm_round() + 1
            if first > 1:  # neighbours already under way
                log.info(
                    "%s: neighbours are past round %d; joining at %d", self.id, first - 1, first
                )
                self.round = first - 1  # keep the gossip of the rounds we join at
            self._started = True
            for r in range(first, cfg.rounds + 1) if central is None else ():
                record = await self._run_round(r)
                self.records.append(record)
                if self.out_dir is not None:
                    append_record(node_log_path(self.out_dir, self.id), record)
                log.info(
                    "%s: round %d acc %.4f peers %s%s",
                    self.id,
                    r,
                    record["test_acc"],
                    record["peers"],
                    " (dropout)" if record.get("dropout") else "",
                )
                if r < cfg.rounds:  # a late joiner starts after the latest reported round
                    try:
                        await self.transport.set_status("online", round=r)
                    except TransportError as exc:
                        log.warning("%s: could not update presence: %s", self.id, exc)
            try:
                await self.transport.set_status("done", round=cfg.rounds)
            except TransportError as exc:
                log.warning("%s: could not announce done: %s", self.id, exc)
            await self._wait_for(
                lambda: all(self._status(p) != "online" for p in self.neighbours),
                time.monotonic() + cfg.timing.linger_s,
            )
        return self.records


async def run_nodes(cfg: TopologyConfig, node_ids: list[str], options: NodeOptions) -> int:
    """Host several nodes in this process (same wire, same broker); returns how many failed."""
    return await run_all([Node(cfg, nid, options) for nid in node_ids])


async def run_all(nodes: list[Node]) -> int:
    """Run ``nodes`` together in this process; returns how many failed."""
    results = await asyncio.gather(*(n.run() for n in nodes), return_exceptions=True)
    failed = 0
    for node, res in zip(nodes, results, strict=True):
        if isinstance(res, BaseException):
            failed += 1
            log.error("%s failed: %s", node.id, res, exc_info=res)
    return failed
