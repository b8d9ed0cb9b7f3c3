"""Configuration: the topology schema (``schema``), reading it from YAML with ``--set``
overrides and the check of a method's knobs (``load``), and the graphs built from it
(``topology``)."""
