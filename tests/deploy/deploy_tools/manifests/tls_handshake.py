"""Whether an OpenSSL client (Python's ssl module; curl and Prometheus follow the same
rules) accepts a server certificate under a host name, decided by a real TLS handshake
on 127.0.0.1, so the library's own name matching is what is tested, not a copy of it."""

from __future__ import annotations

import socket
import ssl
import tempfile
import threading
from pathlib import Path


def _serve_one_handshake(listener: socket.socket, context: ssl.SSLContext, timeout: float) -> None:
    """Accept one connection and run the server side of its handshake; the client's
    refusal (an alert, a closed socket) is its verdict, not an error here."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    with conn:
        conn.settimeout(timeout)
        try:
            with context.wrap_socket(conn, server_side=True):
                pass
        except (OSError, ssl.SSLError):
            pass


def openssl_name_verdict(ca_pem: bytes, cert_pem: bytes, key_pem: bytes, name: str,
                         timeout: float = 10.0) -> str:
    """'' when a client trusting ``ca_pem`` completes a handshake with a server presenting
    ``cert_pem``/``key_pem`` and verifies it for the host name ``name``; otherwise the
    client's verification message."""
    with tempfile.TemporaryDirectory() as tmp:
        cert_file, key_file = Path(tmp, "server.crt"), Path(tmp, "server.key")
        cert_file.write_bytes(cert_pem)
        key_file.write_bytes(key_pem)
        server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_context.load_cert_chain(str(cert_file), str(key_file))
    client_context = ssl.create_default_context(cadata=ca_pem.decode())
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout)
        server = threading.Thread(target=_serve_one_handshake, args=(listener, server_context, timeout),
                                  daemon=True)
        server.start()
        try:
            with (socket.create_connection(listener.getsockname(), timeout) as raw,
                  client_context.wrap_socket(raw, server_hostname=name)):
                verdict = ""
        except ssl.SSLCertVerificationError as exc:
            verdict = exc.verify_message or str(exc)
        finally:
            server.join(timeout)
    return verdict
