"""Launch: starting a local swarm of node processes (``swarm``) and a private Mosquitto broker
(``broker``)."""
