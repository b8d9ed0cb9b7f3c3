"""The ``network:`` and ``devices:`` sections: emulated links and devices (docs/design.md,
"Emulated devices and links").

A topology may describe the swarm it stands for rather than the machine it runs on: a link
per node, host or edge (latency, jitter, bandwidth, loss; presets ``lan``, ``wifi``, ``lte``,
``wan``) and a device per node or host (a compute-speed factor, offline windows). The node
applies both itself (the transport delays what it receives, the trainer sleeps for the
speed), so every machine can run them; every random draw is seeded with the topology's
``seed``. Like :mod:`p2pfl.config.schema`, this module imports nothing of p2pfl.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


LinkPreset = Literal["lan", "wifi", "lte", "wan"]


class LinkParams(_Strict):
    """One access link, as a node's traffic sees it. A message of ``B`` bytes from ``a`` to
    ``b`` takes ``latency + jitter draw + B / bandwidth`` over the path (see
    :func:`path_between`). Both lanes are reliable (TCP), so a lost packet is not a lost
    message: each packet-sized piece is lost with probability ``loss`` and costs one
    retransmission timeout (max(200 ms, 2 × latency))."""

    latency_ms: float = Field(0.0, ge=0, le=60_000, description="one-way delay")
    jitter_ms: float = Field(0.0, ge=0, le=60_000, description="std of a normal draw, cut at 0")
    bandwidth_mbps: float | None = Field(
        None, gt=0, description="megabits per second (None: unlimited)"
    )
    loss: float = Field(0.0, ge=0, lt=1, description="packet loss probability")


PRESETS: dict[str, LinkParams] = {
    # an office switch, a home Wi-Fi, a 4G phone, a cross-continent link
    "lan": LinkParams(latency_ms=0.5, jitter_ms=0.1, bandwidth_mbps=1000.0, loss=0.0),
    "wifi": LinkParams(latency_ms=5.0, jitter_ms=2.0, bandwidth_mbps=50.0, loss=0.001),
    "lte": LinkParams(latency_ms=50.0, jitter_ms=10.0, bandwidth_mbps=10.0, loss=0.005),
    "wan": LinkParams(latency_ms=100.0, jitter_ms=5.0, bandwidth_mbps=20.0, loss=0.001),
}


class LinkSpec(_Strict):
    """A link setting for some nodes (their access link), hosts, or one edge. ``preset``
    gives the defaults that the other fields then override."""

    nodes: list[str] | None = Field(None, description="these nodes' access links")
    hosts: list[str] | None = Field(None, description="the nodes pinned to these hosts")
    fraction: float | None = Field(
        None, gt=0, le=1, description="or: this fraction of the nodes, drawn with the seed"
    )
    edge: tuple[str, str] | None = Field(None, description="or: the path between two nodes")
    preset: LinkPreset | None = None
    latency_ms: float | None = Field(None, ge=0, le=60_000)
    jitter_ms: float | None = Field(None, ge=0, le=60_000)
    bandwidth_mbps: float | None = Field(None, gt=0)
    loss: float | None = Field(None, ge=0, lt=1)

    @model_validator(mode="after")
    def _check_who(self) -> LinkSpec:
        given = [x for x in (self.nodes, self.hosts, self.fraction, self.edge) if x is not None]
        if len(given) != 1:
            raise ValueError("a link names one of: nodes, hosts, fraction, edge")
        return self

    def params(self) -> LinkParams:
        base = PRESETS[self.preset] if self.preset else LinkParams()
        over = {
            k: v
            for k in ("latency_ms", "jitter_ms", "bandwidth_mbps", "loss")
            if (v := getattr(self, k)) is not None
        }
        return base.model_copy(update=over)


class NetworkConfig(_Strict):
    """Emulated links (none by default: the real network only)."""

    default: LinkPreset | LinkParams | None = Field(
        None, description="every node's access link unless a link below names it"
    )
    links: list[LinkSpec] = Field(default_factory=list)
    kernel: bool = Field(
        False,
        description="also shape with the kernel (htb/tbf) where the node runs in its own "
        "network namespace; the transport's emulation stays the default",
    )

    @property
    def active(self) -> bool:
        return self.default is not None or bool(self.links)


class DeviceSpec(_Strict):
    """Some devices' compute speed and availability."""

    nodes: list[str] | None = Field(None, description="these nodes")
    hosts: list[str] | None = Field(None, description="the nodes pinned to these hosts")
    fraction: float | None = Field(
        None, gt=0, le=1, description="or: this fraction of the nodes, drawn with the seed"
    )
    speed: float = Field(
        1.0, gt=0, le=1, description="compute speed against this machine (0.1: ten times slower)"
    )
    offline: list[tuple[float, float]] = Field(
        default_factory=list,
        description="[start_s, end_s] windows, in seconds since the node started, when the "
        "device is off the network",
    )

    @model_validator(mode="after")
    def _check(self) -> DeviceSpec:
        given = [x for x in (self.nodes, self.hosts, self.fraction) if x is not None]
        if len(given) != 1:
            raise ValueError("a device entry names one of: nodes, hosts, fraction")
        for a, b in self.offline:
            if not (0 <= a < b) or not math.isfinite(b):
                raise ValueError(f"offline window [{a}, {b}]: need 0 <= start < end")
        return self


def chosen_nodes(
    i: int,
    kind: str,
    nodes: list[str] | None,
    hosts: list[str] | None,
    fraction: float | None,
    seed: int,
    node_hosts: dict[str, str | None],
) -> list[str]:
    """The nodes the ``i``-th entry of a section (``kind``: ``attack``, ``link``, ``device``)
    names: ``nodes`` as given, the nodes pinned to ``hosts``, or ``round(fraction × N)``
    (at least 1) drawn with the seed, the kind and the entry's position, so every node
    computes the same set."""
    ids = sorted(node_hosts)
    if nodes is not None:
        return list(nodes)
    if hosts is not None:
        return [n for n in ids if node_hosts[n] in set(hosts)]
    k = max(1, round((fraction or 0) * len(ids)))
    return random.Random(f"{seed}:{kind}:{i}").sample(ids, k)


def access_links(
    net: NetworkConfig, seed: int, node_hosts: dict[str, str | None]
) -> dict[str, LinkParams]:
    """Each node's access link (later entries win); nodes with none are absent."""
    out: dict[str, LinkParams] = {}
    if net.default is not None:
        base = PRESETS[net.default] if isinstance(net.default, str) else net.default
        out = dict.fromkeys(node_hosts, base)
    for i, spec in enumerate(net.links):
        if spec.edge is None:
            for n in chosen_nodes(
                i, "link", spec.nodes, spec.hosts, spec.fraction, seed, node_hosts
            ):
                out[n] = spec.params()
    return out


def path_between(
    a: str, b: str, access: dict[str, LinkParams], net: NetworkConfig
) -> LinkParams | None:
    """The emulated path from ``a`` to ``b``: an ``edge`` entry when one names the pair
    (either order; the last wins), else both access links in series (latencies add,
    jitters add in quadrature, the narrower bandwidth, losses compound). None: no emulation."""
    for spec in reversed(net.links):
        if spec.edge is not None and set(spec.edge) == {a, b}:
            return spec.params()
    la, lb = access.get(a), access.get(b)
    if la is None and lb is None:
        return None
    la, lb = la or LinkParams(), lb or LinkParams()
    bws = [x for x in (la.bandwidth_mbps, lb.bandwidth_mbps) if x is not None]
    return LinkParams(
        latency_ms=la.latency_ms + lb.latency_ms,
        jitter_ms=math.hypot(la.jitter_ms, lb.jitter_ms),
        bandwidth_mbps=min(bws) if bws else None,
        loss=1 - (1 - la.loss) * (1 - lb.loss),
    )


def paths_to(
    node: str, net: NetworkConfig, seed: int, node_hosts: dict[str, str | None]
) -> dict[str, LinkParams]:
    """The emulated path from every other node of the topology to ``node`` (what ``node``
    receives crosses it: :mod:`p2pfl.wire.emulation`); nodes with no emulated path are
    absent, so the result is empty when the section emulates nothing."""
    if not net.active:
        return {}
    access = access_links(net, seed, node_hosts)
    paths = {a: path_between(a, node, access, net) for a in node_hosts if a != node}
    return {a: p for a, p in paths.items() if p is not None}


def device_of(
    devices: list[DeviceSpec], node: str, seed: int, node_hosts: dict[str, str | None]
) -> tuple[float, list[tuple[float, float]]]:
    """``node``'s (speed, offline windows); later entries win. (1.0, []) when none names it."""
    speed, offline = 1.0, []
    for i, spec in enumerate(devices):
        if node in chosen_nodes(
            i, "device", spec.nodes, spec.hosts, spec.fraction, seed, node_hosts
        ):
            speed, offline = spec.speed, sorted(spec.offline)
    return speed, offline
