"""Configuration, the ground floor: the topology schema (``schema``) and its sections
(``dataset_schema``, ``runtime_schema``, ``privacy_schema``, ``emulation``, on the
``strict`` base), the bounds on every count (``bounds``) and the graphs built from a
topology (``topology``). Reading a topology from YAML and checking it against the methods,
data and models lives one floor up, in :mod:`p2pfl.check`."""
