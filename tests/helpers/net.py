"""Local ports and Prometheus scrapes for tests that start servers on 127.0.0.1."""

from __future__ import annotations

import http.client
import socket
import urllib.request
from typing import Dict, Optional, Tuple

#: One scraped series: (metric sample name, labels as a sorted tuple of (name, value) pairs).
Series = Tuple[str, Tuple[Tuple[str, str], ...]]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (nothing listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1 (e.g. the exporters of local ranks 0 and 1).

    Raises RuntimeError when 100 tries found no such pair."""
    for _ in range(100):
        p = free_port()
        if p >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def scrape(url: str, *, down_ok: bool = False) -> Optional[Dict[Series, float]]:
    """``{(name, sorted labels): value}`` of every sample a Prometheus endpoint (``.../metrics``) serves,
    parsed with prometheus-client's own parser. An endpoint that does not answer raises OSError, or gives
    None with ``down_ok=True`` (for polling a server that is starting).

    With ``down_ok=True`` an answer that is not HTTP (``http.client.HTTPException``) also gives None: the ports of
    :func:`free_port` come from the kernel's ephemeral range, and a connect to such a port on which nothing
    listens yet can pick that same port as its source and connect to itself (TCP simultaneous open), so the
    request comes back as the "status line" (``BadStatusLine: GET /metrics HTTP/1.1``)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except (OSError, http.client.HTTPException):
        if down_ok:
            return None
        raise
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}
