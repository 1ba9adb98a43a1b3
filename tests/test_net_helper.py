"""tests/helpers/net.py's scrape while a server starts: a port that answers with something other than HTTP (as a
socket connected to itself does, echoing the request) reads as down, not as an error, when polling."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.helpers.net import scrape


def _echo_once(srv: socket.socket) -> None:
    conn, _ = srv.accept()
    with conn:
        conn.sendall(conn.recv(4096))  # the request back, as a self-connected socket reads it


@pytest.mark.parametrize("down_ok", [True, False])
def test_an_echoed_request_is_down_while_polling_and_an_error_otherwise(down_ok):
    import http.client

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        t = threading.Thread(target=_echo_once, args=(srv,), daemon=True)
        t.start()
        url = f"http://127.0.0.1:{srv.getsockname()[1]}/metrics"
        if down_ok:
            assert scrape(url, down_ok=True) is None
        else:
            with pytest.raises(http.client.BadStatusLine):
                scrape(url)
        t.join(5)
