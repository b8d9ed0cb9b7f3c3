"""An emulated device (the topology's ``devices:``; docs/design.md, "Emulated devices and
links"): a compute-speed factor and offline windows, applied by the node itself so that any
machine can stand in for a slower one.

- **Speed** ``s`` ∈ (0, 1]: after each local training that took ``t`` seconds here, the node
  waits ``t (1/s − 1)`` more, on the event loop (it keeps answering its peers, as a slow
  device's network stack does while its accelerator works). ``s = 1``: no wait.
- **Offline windows** ``[start_s, end_s]``, in seconds since the node started: a round that
  would start inside a window waits for its end (:meth:`EmulatedDevice.offline_left`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from p2pfl.config.emulation import device_of
from p2pfl.config.schema import TopologyConfig
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)


@dataclass
class EmulatedDevice:
    """One node's emulated speed and availability; offline windows count from ``started``
    (``time.monotonic``): its creation, then the start of its rounds (:meth:`start_clock`)."""

    speed: float = 1.0
    offline: list[tuple[float, float]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, cfg: TopologyConfig, node: str) -> EmulatedDevice:
        speed, offline = device_of(cfg.devices, node, cfg.seed, cfg.node_hosts)
        return cls(speed=speed, offline=offline)

    @property
    def emulated(self) -> bool:
        return self.speed < 1.0 or bool(self.offline)

    def extra_compute_s(self, took_s: float) -> float:
        """The wait that makes ``took_s`` of compute here last ``took_s / speed``."""
        return max(0.0, took_s) * (1.0 / self.speed - 1.0)

    def start_clock(self) -> None:
        """The node starts its rounds now: its offline windows count from here, so a window
        at the run's start is not spent on start-up (docs/design.md, "Emulated devices and
        links"), however long the process took to load."""
        self.started = time.monotonic()

    def offline_left(self, now: float | None = None) -> float:
        """Seconds until the current offline window ends (0: online now)."""
        t = (time.monotonic() if now is None else now) - self.started
        for a, b in self.offline:
            if a <= t < b:
                return b - t
        return 0.0


class NodeDevice:
    """The device port: the torch device node ``node_id`` computes on, its emulated speed
    and offline windows (:class:`EmulatedDevice`), and whether it is off the network now.
    ``set_status`` updates the node's presence (``offline``, then ``online``)."""

    def __init__(
        self,
        node_id: str,
        torch_device: torch.device,
        emulated: EmulatedDevice,
        set_status: Callable[..., Awaitable[Any]],
    ):
        self.id = node_id
        self.torch = torch_device
        self.emulated = emulated
        self._set_status = set_status
        self.off_network = False  # inside an emulated offline window: no pull is served

    async def sit_out_offline(self, round_no: int) -> float:
        """Inside an emulated offline window (``devices[].offline``): leave the network
        until it ends (presence ``offline``, no pull served, no round run), then come back
        ``online``; returns the seconds spent off (0: online)."""
        left = self.emulated.offline_left()
        if left <= 0:
            return 0.0
        log.info("%s: emulated device offline for %.1f s before round %d", self.id, left, round_no)
        self.off_network = True
        try:
            with contextlib.suppress(TransportError):
                await self._set_status("offline")
            await asyncio.sleep(left)
        finally:
            self.off_network = False
        with contextlib.suppress(TransportError):
            await self._set_status("online")
        return left
