"""Checking a topology before anything starts: reading YAML with ``--set`` overrides and
each method's knobs (``load``), whether the data opens, the partition fits it and the model
takes it (``preflight``), and the one path every command reads a topology through
(``checked``). It sits above :mod:`p2pfl.config`, :mod:`p2pfl.algorithms` and
:mod:`p2pfl.learning`, so the schema never imports what it configures."""
