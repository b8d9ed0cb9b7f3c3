"""The one error of secure aggregation."""

from __future__ import annotations

from p2pfl.errors import P2PFLError


class SecAggError(P2PFLError, ValueError):
    """A secure-aggregation step refused: a message out of order or malformed, a request
    that would reveal more than the protocol allows, too few members or shares to go on, or
    a value the field cannot hold. The round's attempt cannot complete as asked; the text
    says why and names the peer where there is one."""
