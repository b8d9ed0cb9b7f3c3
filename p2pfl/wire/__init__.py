"""Wire, on the ground floor: what nodes send each other, and how. Message and tensor
encoding (``codec``), compressed states (``compress``, ``compress_format``, ``topk``,
``streams``), transfer digests (``digest``), the envelope (``envelope``), weight transfers
(``transfers``), the transport a node uses (``transport``) over its ordered lanes (``lane``:
the MQTT lane ``mqtt_lane``, the direct TCP lane ``direct_lane`` over ``direct``), the one
receive pipeline (``receive``), protocol versions (``versions``), the broker's bridges
(``bridges``), emulated links and kernel shaping (``emulation``, ``shaping``), errors, byte
counters and status telemetry (``errors``, ``stats``, ``status``), mDNS (``discovery``) and
socket and allocator options (``loop``, ``sysopt``). It knows nothing of methods or rounds:
round code reaches it only through :class:`p2pfl.services.exchange.Exchange`."""
