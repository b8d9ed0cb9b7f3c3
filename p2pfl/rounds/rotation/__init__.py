"""The rotating-aggregator protocol of centralized methods (docs/architecture.md, "Round
flow"): the driver composing the roles (``centralized``) on what each knows of its node
(``role``); one member's view of the rotation (``rotation``), whose presence it hears
(``hearing``), its steps (``member``), its late offers (``late``), the attempt loop and its
failover (``succession``), observing and catch-up (``observe``); the aggregator's role
(``aggregator``) and its quorum collection (``quorum_close``); the auditor's (``auditor``)
and the audit's pure parts (``audit``); the round plan (``plans``), the order of aggregators
(``election``), the pure rules of quorum rounds (``quorum``), secure aggregation
(``secure_round``), the lineage of a result (``lineage``), and reachability and partitions
(``reach``, ``partition``)."""
