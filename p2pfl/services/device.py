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

import time
from dataclasses import dataclass, field

from p2pfl.config.emulation import device_of
from p2pfl.config.schema import TopologyConfig


@dataclass
class EmulatedDevice:
    """One node's emulated speed and availability, from its start (``time.monotonic``)."""

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

    def offline_left(self, now: float | None = None) -> float:
        """Seconds until the current offline window ends (0: online now)."""
        t = (time.monotonic() if now is None else now) - self.started
        for a, b in self.offline:
            if a <= t < b:
                return b - t
        return 0.0
