"""`is_loopback` decides whether a bind needs CURVE keys: it must parse the address, not match a prefix."""

from __future__ import annotations


def test_is_loopback_parses_the_address():
    """One loopback address (or localhost) only: a second ZeroMQ endpoint after ';', a name that merely starts with
    '127.', a wildcard or another host are not loopback (they need CURVE keys to bind)."""
    from pslab.collectives.curve import is_loopback
    for host in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("127.0.0.1:1;0.0.0.0", "127.evil.example", "0.0.0.0", "*", "10.0.0.5", "", "::", "127.0.0.1 0.0.0.0",
                 "127.0.0.1;0.0.0.0", "127.0.0.1;127.0.0.1", "tcp://127.0.0.1", "127.0.0.1:5555", "127.0.0.1,0.0.0.0",
                 "localhost;0.0.0.0", "[::1];0.0.0.0", "[::1]:1;[::]:2", "127.0.0.1\n0.0.0.0", "127.1"):
        assert not is_loopback(host), host
