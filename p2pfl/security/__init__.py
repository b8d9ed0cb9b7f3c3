"""Security: the swarm CA, node certificates, revocation and broker ACL (``certs``), and message
signatures, replay protection and TLS contexts (``signing``)."""
