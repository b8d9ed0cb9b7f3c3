"""Configuration: the topology schema, loading and ``--set`` overrides (``schema``), and the graphs
built from it (``topology``)."""
