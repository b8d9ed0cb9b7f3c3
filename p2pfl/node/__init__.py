"""Node: the daemon that runs one node's lifecycle (``daemon``), the services its round
drivers share (``services``), the rounds of decentralized methods (``decentralized``), the
rounds of centralized methods under a rotating aggregator (``centralized``; the aggregator's
role: ``aggregator``; the plan every member shares: ``plans``), and the choice of that
aggregator (``election``)."""
