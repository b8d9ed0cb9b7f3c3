"""The error of a privacy setting that cannot work (docs/algorithms.md, "Differential
privacy"), shared by both levels' accountants."""

from __future__ import annotations

from p2pfl.errors import P2PFLError


class PrivacyError(P2PFLError, ValueError):
    """A privacy setting that cannot work (e.g. a target ε no noise can reach): ``field``
    is the config field, ``reason`` why; ``str()`` is ``"field: reason"``."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")
