"""Event-loop and logging hygiene for the MQTT client.

**Late acknowledgements.** aiomqtt stops waiting for a SUBACK or UNSUBACK after its
timeout (or when the call is cancelled) and forgets the packet id; when the broker's
acknowledgement then arrives (a loop starved by hundreds of nodes in one process), it logs
``Unexpected message ID`` at error level with a traceback. The subscription change itself
is made (or not) by the broker either way, and the caller already got its timeout.
:data:`CLIENT_LOG` is the logger the lane hands to aiomqtt: :class:`LateAcknowledgements`
turns those records into one debug line of this module.

**Closed-socket races.**
paho asks aiomqtt to watch its socket for writing from whichever thread it runs on, so
aiomqtt schedules ``loop.add_writer(fd, …)`` with ``call_soon_threadsafe``. When the broker
closes the connection between that schedule and its run, the descriptor is already closed
and asyncio's default handler logs ``OSError: [Errno 9] Bad file descriptor`` with a full
traceback. Nothing is lost: the client reports the lost connection on its own and the
transport reconnects (or fails after ``timing.broker_timeout_s``). The handler below turns
exactly that race into one debug line and passes every other error to the loop's previous
handler.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

log = logging.getLogger(__name__)


class LateAcknowledgements(logging.Filter):
    """Drop aiomqtt's ``Unexpected message ID`` records (an acknowledgement for a call that
    stopped waiting), logging one debug line instead; let every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Unexpected message ID"):
            return True
        log.debug("acknowledgement after its call stopped waiting: %s", message)
        return False


#: the logger aiomqtt (and paho through it) writes to for every MQTT lane
CLIENT_LOG = logging.getLogger("mqtt.p2pfl")
CLIENT_LOG.addFilter(LateAcknowledgements())

#: loop methods whose scheduled call races with a socket the broker has just closed
_WATCHERS = frozenset({"add_writer", "add_reader"})


def is_closed_socket_race(context: dict[str, Any]) -> bool:
    """True when ``context`` (asyncio's exception context) is a scheduled ``add_writer`` /
    ``add_reader`` that found its descriptor already closed."""
    exc = context.get("exception")
    if not isinstance(exc, OSError) or exc.errno != errno.EBADF:
        return False
    callback = getattr(context.get("handle"), "_callback", None)
    return getattr(callback, "__name__", None) in _WATCHERS


def quiet_closed_socket_races(loop: asyncio.AbstractEventLoop) -> None:
    """Install the handler on ``loop``, keeping its previous handler for everything else."""
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if is_closed_socket_race(context):
            log.debug(
                "socket closed before its watcher was added (broker gone): %s",
                context.get("exception"),
            )
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
