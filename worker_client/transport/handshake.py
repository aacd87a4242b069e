"""Naming why a connection to a ps-server fails at the TLS layer.

gRPC reports a failed TLS handshake as UNAVAILABLE, the status of a server
that is down, so a misconfigured client would retry until its
connect_timeout and then blame the network. When a connect attempt fails,
the client calls :func:`diagnose`: it repeats the handshake with Python's
``ssl`` module and the client's own settings, then speaks the first bytes
of HTTP/2 over it. What it goes by are facts of the exchange, never an
error's text: the certificate verification code OpenSSL reports, whether
the server's first bytes are a TLS record or an HTTP/2 frame, whether the
server closed the connection right after the handshake, and which TLS
settings the client has.

A server that is down, unreachable or slow gives no finding (None): the
caller keeps retrying as for any unavailability.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from typing import TypeVar

from wehub_ps.cluster import ClusterConfigError, split_host_port
from worker_client.errors import PSTLSError, TLSProblem
from worker_client.transport.credentials import TlsMaterial

__all__ = ["diagnose"]

T = TypeVar("T")

# The client's opening of an HTTP/2 connection: the preface and an empty SETTINGS frame.
_HTTP2_OPENING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 0x04, 0, 0, 0, 0, 0])
_HTTP2_SETTINGS = 0x04  # frame type, the 4th byte of a frame header
_TLS_RECORD_TYPES = (0x15, 0x16)  # alert, handshake: what a TLS server's first record is
# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_NAME_MISMATCH_CODES = (62, 64)
# SSLErrors that mean "the connection ended", not "the peer refused with a TLS alert".
_CONNECTION_ENDED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


def diagnose(address: str, tls: TlsMaterial | None, server_name: str | None,
             timeout: float) -> PSTLSError | None:
    """The TLS mismatch between this client and ``address``, or None when there is none to name.

    Blocks for at most about ``timeout`` seconds (two connections at most).
    """
    try:
        host, port = split_host_port(address)
    except ClusterConfigError:
        return None
    deadline = time.monotonic() + max(0.1, timeout)
    found = (_check_plaintext_client(host, port, deadline) if tls is None
             else _check_tls_client(host, port, tls, server_name, deadline))
    if found is None:
        return None
    problem, message = found
    return PSTLSError(f"connect: ps-server {address}: {message}", address=address, reason=problem.value)


def _check_plaintext_client(host: str, port: int, deadline: float) -> tuple[TLSProblem, str] | None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asking whether the server speaks TLS at all
    try:
        with _Connection(host, port, deadline) as conn:
            tls = conn.start_tls(context, None)
            try:
                conn.pump(tls.do_handshake)
            except (ssl.SSLError, OSError):
                pass  # a refusal still shows in the first bytes the server sent
            speaks_tls = conn.first_record_is_tls()
    except OSError:
        return None
    if speaks_tls:
        return (TLSProblem.SERVER_USES_TLS,
                "the server speaks TLS (--tls-cert) and this client connects in plaintext: give the client "
                "tls_ca (PS_TLS_CA), and tls_cert/tls_key (PS_TLS_CERT/PS_TLS_KEY) if the server also has "
                "--tls-client-ca")
    return None


def _check_tls_client(host: str, port: int, tls: TlsMaterial, server_name: str | None,
                      deadline: float) -> tuple[TLSProblem, str] | None:
    name = server_name or host
    context = tls.context
    try:
        with _Connection(host, port, deadline) as conn:
            session = conn.start_tls(context, name)
            try:
                conn.pump(session.do_handshake)
            except ssl.SSLCertVerificationError as exc:
                return _verification_problem(exc, tls, name, server_name)
            except TimeoutError:
                return None
            except (ssl.SSLError, OSError) as exc:
                if not conn.first_record_is_tls():
                    if _answers_http2_in_plaintext(host, port, deadline):
                        return (TLSProblem.SERVER_PLAINTEXT,
                                "the server speaks plaintext (no --tls-cert) and this client is set up for "
                                "TLS: start the server with --tls-cert/--tls-key, or leave out the client's "
                                "tls_ca/tls_cert/tls_key (PS_TLS_*)")
                    return None
                if not isinstance(exc, ssl.SSLError) or isinstance(exc, _CONNECTION_ENDED):
                    return None
                return (TLSProblem.HANDSHAKE_REFUSED,
                        f"the server refused the TLS handshake (OpenSSL: {exc.reason}): "
                        + _client_certificate_advice(tls))
            # The handshake is done; with mutual TLS the server checks the client's
            # certificate now, and closes the connection if it does not accept it.
            try:
                conn.pump(lambda: session.write(_HTTP2_OPENING))
                answer = conn.pump(lambda: session.read(9))
            except TimeoutError:
                return None
            except (ssl.SSLError, OSError):
                answer = b""
    except OSError:
        return None
    if answer:
        return None  # it answers over TLS: the trouble is elsewhere
    if tls.cert is None:
        return (TLSProblem.CLIENT_CERTIFICATE_REQUIRED,
                "the server requires a client certificate (mutual TLS, --tls-client-ca) and this client has "
                "none: give it tls_cert and tls_key (PS_TLS_CERT/PS_TLS_KEY) issued by that CA")
    return (TLSProblem.CLIENT_CERTIFICATE_REFUSED,
            "the server closed the connection after the TLS handshake: it did not accept this client's "
            "certificate (tls_cert); " + _client_certificate_advice(tls))


def _client_certificate_advice(tls: TlsMaterial) -> str:
    if tls.cert is None:
        return "if the server has --tls-client-ca, give the client tls_cert and tls_key issued by that CA"
    return ("the client's tls_cert must be issued by the CA in the server's --tls-client-ca, valid now, and "
            "for client authentication")


def _verification_problem(exc: ssl.SSLCertVerificationError, tls: TlsMaterial, name: str,
                          server_name: str | None) -> tuple[TLSProblem, str]:
    if exc.verify_code in _NAME_MISMATCH_CODES:
        where = ("server_name (PS_SERVER_NAME)" if server_name else
                 "the host of the address; set server_name (PS_SERVER_NAME) to a name the certificate lists")
        return (TLSProblem.SERVER_NAME_MISMATCH,
                f"the server's certificate is not valid for {name!r}, {where}: {exc.verify_message}")
    roots = "tls_ca (PS_TLS_CA)" if tls.ca is not None else "the system's CA certificates (no tls_ca given)"
    return (TLSProblem.SERVER_CERTIFICATE_UNTRUSTED,
            f"the server's certificate does not verify with {roots}: {exc.verify_message}; give the client "
            "the CA that issued the server's --tls-cert")


def _answers_http2_in_plaintext(host: str, port: int, deadline: float) -> bool:
    """Whether the server answers a plaintext HTTP/2 opening with a SETTINGS frame."""
    try:
        with _Connection(host, port, deadline) as conn:
            conn.sock.sendall(_HTTP2_OPENING)
            answer = conn.receive()
    except OSError:
        return False
    return len(answer) >= 4 and answer[3] == _HTTP2_SETTINGS


class _Connection:
    """One TCP connection with, optionally, a TLS client over memory BIOs.

    The BIOs let the check see the server's raw first bytes (a TLS record or
    not) that ``ssl.SSLSocket`` would hide. Every wait ends at ``deadline``
    (TimeoutError).
    """

    def __init__(self, host: str, port: int, deadline: float) -> None:
        self._deadline = deadline
        self.sock = socket.create_connection((host, port), timeout=self._remaining())
        self.first = b""
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sock.close()

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the TLS check ran out of time")
        return remaining

    def receive(self) -> bytes:
        self.sock.settimeout(self._remaining())
        data = self.sock.recv(65536)
        if not self.first:
            self.first = data[:3]
        return data

    def first_record_is_tls(self) -> bool:
        """Whether the server's first bytes were a TLS record header (type, version 3.x)."""
        return len(self.first) >= 2 and self.first[0] in _TLS_RECORD_TYPES and self.first[1] == 0x03

    def start_tls(self, context: ssl.SSLContext, server_hostname: str | None) -> ssl.SSLObject:
        return context.wrap_bio(self._incoming, self._outgoing, server_side=False,
                                server_hostname=server_hostname)

    def pump(self, operation: Callable[[], T]) -> T:
        """Run a TLS operation, moving bytes between the BIOs and the socket until it completes."""
        while True:
            try:
                result = operation()
            except ssl.SSLWantReadError:
                self._flush()
                data = self.receive()
                if data:
                    self._incoming.write(data)
                else:
                    self._incoming.write_eof()
                continue
            self._flush()
            return result

    def _flush(self) -> None:
        pending = self._outgoing.read()
        if pending:
            self.sock.settimeout(self._remaining())
            self.sock.sendall(pending)
