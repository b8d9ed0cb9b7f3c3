"""The rotating-aggregator protocol of centralized methods: the driver and a member's
part of a round (``centralized``), the aggregator's role (``aggregator``), the auditor's
(``auditor``) and the audit's pure parts (``audit``), the round plan (``plans``), the order
of aggregators (``election``), quorum rounds (``quorum``), secure aggregation
(``secure_round``), the lineage of a result (``lineage``), and reachability and partitions
(``reach``, ``partition``)."""
