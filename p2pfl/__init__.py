"""p2pfl: a peer-to-peer federated learning node daemon over MQTT."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 3
