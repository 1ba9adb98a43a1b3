"""Fixtures shared by the agent's tests."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture(scope="session")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (EC P-256, valid one day) made by ``openssl``: (cert.pem, key.pem)
    paths, for the exporter's TLS tests. Skips the test when openssl cannot make one."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "c.pem", d / "k.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"openssl cannot make a test certificate: {r.stderr[-200:]!r}")
    return str(cert), str(key)
