"""Node: the daemon that runs one node's lifecycle and decentralized rounds (``daemon``), the
rounds of centralized methods under a rotating aggregator (``centralized``), and the choice of
that aggregator (``election``)."""
