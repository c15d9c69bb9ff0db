"""The test suite's network guard (conftest): a test that reaches beyond this machine fails, naming the host; the
loopback servers some tests start stay reachable."""

import socket

import pytest

from conftest import NetworkCall


@pytest.mark.parametrize("host", ["huggingface.co", "www.modelscope.cn", "1.1.1.1", "2606:4700:4700::1111"])
def test_hosts_beyond_this_machine_are_refused(host):
    with pytest.raises(NetworkCall, match="tests run offline"):
        socket.create_connection((host, 443), timeout=2)


def test_loopback_stays_reachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        socket.create_connection(("127.0.0.1", server.getsockname()[1]), timeout=2).close()
