"""What a node offers its round driver: :class:`~p2pfl.services.bundle.NodeServices`, a
small bundle of ports, each a module of its own: ``peers`` (presence, waits, the
refused-peer gate), ``exchange`` (prepare, serve, pull, gossip, send: the only road to the
transport), ``robust`` (admit, cap, reject, trust), ``ledger`` (meter, status, round
record, drop counts); and ``training``, ``privacy``, ``checkpoint``, ``device``."""
