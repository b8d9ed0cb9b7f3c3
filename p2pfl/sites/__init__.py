"""A site's standing federation (docs/design.md, "Site policy", "The site daemon"), in rooms:
``consent/`` (messages, agreement, ledger, run specs), ``policy/`` (the rule and the path of a
decision, the site's own bindings checked), ``daemon/`` (lifecycle, site file, admin socket,
observability, systemd, logs), ``runs/`` (workers, slots, child processes, series, data
versions), ``models/`` (store, gate, serving) and ``trust/`` (CRLs, enrolment);
``commands.py`` is the wing's command line."""
