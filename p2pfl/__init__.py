"""p2pfl: a peer-to-peer federated learning node daemon over MQTT.

The Python API (:mod:`p2pfl.launch.api`): ``load_topology``, ``run_swarm`` (a run whose
``records`` are rows), ``load_model`` and ``register_method``, each imported on first use.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 4  # what this release runs
# the oldest protocol it still speaks, for swarms that upgrade device by device (README.md,
# "Rolling upgrades"): 3's envelope is 4's; while a peer runs 3 a node sends only what 3
# reads (whole announcements, none of 4's kinds: docs/wire.md, "Protocol versions")
MIN_PROTOCOL_VERSION = 3

# names imported on first use, so ``import p2pfl`` stays cheap (no torch): name → "module:attr"
_LAZY = {
    "load_model": "p2pfl.export:load_model",
    "load_topology": "p2pfl.launch.api:load_topology",
    "run_swarm": "p2pfl.launch.api:run_swarm",
    "Run": "p2pfl.launch.api:Run",
    "register_method": "p2pfl.algorithms:register_method",
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'p2pfl' has no attribute {name!r}")
    import importlib

    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
