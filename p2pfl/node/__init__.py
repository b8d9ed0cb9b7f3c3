"""Node: one node's lifecycle (``daemon``: load, connect, wait for its peers, hand the
rounds to its driver, linger, leave) and its wiring (``wiring``: the transport, TLS and
signing, the direct lane, emulated links, mDNS). Round protocols live in
:mod:`p2pfl.rounds`, the services they share in :mod:`p2pfl.services`."""
