"""A site's own models: the model store and its promotion gate, and the served model over HTTP (docs/design.md, "A site's own models")."""
