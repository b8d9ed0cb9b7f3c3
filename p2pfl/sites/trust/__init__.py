"""Trust that spreads: newer CRLs of the swarm CA taken from trust messages, applied and carried on; enrolment of a new device (docs/design.md, "Trust that spreads")."""
