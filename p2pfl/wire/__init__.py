"""Wire: what nodes send each other over MQTT. Message and tensor encoding (``codec``), transfer
digests (``digest``), topics, envelopes and weight transfers (``transport``), mDNS broker discovery
(``discovery``) and allocator tuning for large transfers (``sysopt``)."""
