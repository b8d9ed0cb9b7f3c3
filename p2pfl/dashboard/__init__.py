"""The live web dashboard of a swarm (docs/architecture.md, "Dashboard").

``p2pfl swarm --dashboard`` and ``p2pfl dashboard RUN_DIR`` serve one local page that shows
the topology, each node's state, weights moving, accuracy, bytes and round time per round,
the aggregator of each round (centralized methods) and UA-PDFL's decisions. Its modules:

- :mod:`p2pfl.dashboard.runstate`: the run directory (config, records tailed as they grow,
  summary);
- :mod:`p2pfl.dashboard.live`: what the broker says now (presence and status telemetry),
  every message checked as untrusted;
- :mod:`p2pfl.dashboard.observer`: the MQTT observer client that feeds it;
- :mod:`p2pfl.dashboard.layout`: where each node is drawn;
- :mod:`p2pfl.dashboard.snapshot`: both merged into the JSON the page polls;
- :mod:`p2pfl.dashboard.server`: the HTTP server and the ways to run it;
- ``static/``: the page (hand-written HTML, CSS and JavaScript; no CDN, works offline).
"""
