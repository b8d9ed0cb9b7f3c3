"""Launch, above the node: a local swarm of node processes (``swarm``), the Python API
(``api``), a private broker (``broker``, ``amqtt_broker``), bridges between site brokers
(``bridge``) and a run's records followed into a tracker (``tracker``)."""
