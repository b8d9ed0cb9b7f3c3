"""Both brokers p2pfl starts (Mosquitto and the embedded amqtt) give the daemon what it relies
on: retained presence, Last Will on a killed client and on a frozen one (keep-alive), QoS 1
delivery, and the packet size limit. The embedded broker refuses TLS before it starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import aiomqtt
import pytest

from p2pfl.launch import broker as broker_mod
from p2pfl.launch.broker import (
    BrokerError,
    BrokerTLS,
    EmbeddedBroker,
    MosquittoBroker,
    make_broker,
)

pytestmark = pytest.mark.integration

# a client in its own process: sets a retained Will, says "online", then waits to be killed
WILL_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, aiomqtt
    async def main(port, keepalive):
        will = aiomqtt.Will("t/presence/v", b"offline", qos=1, retain=True)
        async with aiomqtt.Client("127.0.0.1", port, identifier="victim", will=will,
                                  keepalive=keepalive) as c:
            await c.publish("t/presence/v", b"online", qos=1, retain=True)
            print("UP", flush=True)
            await asyncio.Event().wait()
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    """
)


async def _next(client: aiomqtt.Client, timeout: float) -> aiomqtt.Message:
    async def first():
        async for m in client.messages:
            return m

    return await asyncio.wait_for(first(), timeout)


async def test_retained_message_reaches_a_later_subscriber_and_is_cleared(broker):
    async with aiomqtt.Client(broker.host, broker.port) as c:
        await c.publish("t/presence/a", b"online", qos=1, retain=True)
    async with aiomqtt.Client(broker.host, broker.port) as c:
        await c.subscribe("t/presence/+", qos=1)
        m = await _next(c, 10)
        assert (str(m.topic), m.payload, m.retain) == ("t/presence/a", b"online", True)
        await c.publish("t/presence/a", b"", qos=1, retain=True)  # clears it
    async with aiomqtt.Client(broker.host, broker.port) as c:
        await c.subscribe("t/presence/+", qos=1)
        with pytest.raises(asyncio.TimeoutError):
            await _next(c, 1.0)


@pytest.mark.parametrize("how", ["kill", "freeze"])
async def test_last_will_fires_for_a_killed_or_frozen_client(broker, how):
    """SIGKILL: the socket closes, the Will is published at once. SIGSTOP: the socket stays
    open and silent; the broker must drop it after 1.5 x its 2 s keep-alive."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WILL_CLIENT, str(broker.port), "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "UP"
        async with aiomqtt.Client(broker.host, broker.port) as obs:
            await obs.subscribe("t/presence/v", qos=1)
            assert (await _next(obs, 10)).payload == b"online"  # retained
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            m = await _next(obs, 30)
            took = loop.time() - t0
        assert m.payload == b"offline"
        if how == "freeze":
            assert took >= 2.0, took  # not before the keep-alive ran out
    finally:
        proc.kill()
        proc.wait()


async def test_qos1_delivers_every_message_in_order(broker):
    n = 300
    async with (
        aiomqtt.Client(broker.host, broker.port) as sub,
        aiomqtt.Client(broker.host, broker.port) as pub,
    ):
        await sub.subscribe("t/q/#", qos=1)
        await asyncio.gather(
            *(pub.publish("t/q/x", i.to_bytes(4, "big") + bytes(2000), qos=1) for i in range(n))
        )

        async def take() -> list[int]:
            got = []
            async for m in sub.messages:
                assert m.qos == 1
                got.append(int.from_bytes(m.payload[:4], "big"))
                if len(got) == n:
                    return got

        got = await asyncio.wait_for(take(), 30)
    assert got == list(range(n))


async def test_a_packet_over_the_size_limit_ends_its_connection(tmp_path, broker_kind):
    """``max_packet_size``: 1 MiB passes under a 2 MiB limit; 3 MiB closes the sender's
    connection and reaches no subscriber."""
    with make_broker(broker_kind, workdir=tmp_path / "b", max_packet_mb=2) as b:
        async with aiomqtt.Client(b.host, b.port) as sub:
            await sub.subscribe("t/big", qos=1)
            async with aiomqtt.Client(b.host, b.port) as pub:
                await pub.publish("t/big", bytes(1 << 20), qos=1)
            assert len((await _next(sub, 10)).payload) == 1 << 20
            with pytest.raises(aiomqtt.MqttError):
                async with aiomqtt.Client(b.host, b.port, timeout=3) as pub:
                    # the broker closes the connection: the PUBACK never comes
                    await pub.publish("t/big", bytes(3 << 20), qos=1, timeout=3)
            with pytest.raises(asyncio.TimeoutError):
                await _next(sub, 1.0)


def test_auto_is_mosquitto_where_installed_else_embedded_with_a_warning(
    monkeypatch, caplog, tmp_path
):
    if broker_mod.have_mosquitto():
        assert isinstance(make_broker("auto", workdir=tmp_path), MosquittoBroker)
    monkeypatch.setattr(broker_mod, "have_mosquitto", lambda: False)
    with caplog.at_level(logging.WARNING, logger="p2pfl.broker"):
        chosen = make_broker("auto", workdir=tmp_path)
    assert isinstance(chosen, EmbeddedBroker)
    assert "embedded" in caplog.text and "slower" in caplog.text
    caplog.clear()
    said: list[str] = []  # the launcher prints the note instead of logging it
    with caplog.at_level(logging.WARNING, logger="p2pfl.broker"):
        assert isinstance(make_broker("auto", workdir=tmp_path, warn=said.append), EmbeddedBroker)
    assert len(said) == 1 and "slower" in said[0] and not caplog.text


def test_the_embedded_broker_refuses_tls_and_an_unknown_kind_is_named(monkeypatch, tmp_path):
    tls = BrokerTLS(tmp_path / "certs", "s")
    with pytest.raises(BrokerError, match="needs Mosquitto"):
        make_broker("embedded", tls=tls)
    monkeypatch.setattr(broker_mod, "have_mosquitto", lambda: False)
    with pytest.raises(BrokerError, match="needs Mosquitto"):
        make_broker("auto", tls=tls)
    with pytest.raises(BrokerError, match="unknown broker 'rabbit'"):
        make_broker("rabbit")


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_broker_dies_with_the_process_that_started_it(tmp_path, tied):
    """A site daemon's own broker (``broker: embedded``) is started ``tied``: when the
    daemon is SIGKILLed, its broker does not outlive it holding the port; an untied one
    (a launcher's, stopped by its owner) is left alone by this rule."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from p2pfl.launch.broker import make_broker
        b = make_broker("embedded", workdir={str(tmp_path)!r}).start(tied={tied})
        print(b.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

        def alive() -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has died
            except FileNotFoundError:
                return False

        deadline = time.monotonic() + 30
        while alive() and tied and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive() is not tied
    finally:
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(pid, signal.SIGKILL)
