"""Round protocols: the driver contract and the registry the daemon picks from
(``driver``), the gossip protocol of decentralized methods (``gossip``) and the
rotating-aggregator protocol of centralized ones (``rotation``). Round code uses its node
only through :class:`~p2pfl.services.bundle.NodeServices`; it never reaches the transport."""
