"""TLS credentials and bearer tokens for the client's channels."""

from __future__ import annotations

import os
import ssl
import tempfile
import threading
from dataclasses import dataclass

import grpc

__all__ = ["BearerToken", "TlsMaterial", "tls_material"]


def _pem(value: str | bytes | None, argument: str) -> bytes | None:
    """PEM bytes from bytes or a file path."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{argument}: cannot read {value!r}: {exc}") from None


@dataclass(frozen=True)
class TlsMaterial:
    """The client's TLS settings as PEM bytes, read once when the client is built.

    ``ca`` None: the system's roots verify the server. ``cert`` and ``key``
    (together or neither): the client certificate for mutual TLS.
    ``context``: the same settings for Python's ssl module (checking the
    handshake, worker_client.transport.handshake), verifying as gRPC does.
    """

    ca: bytes | None
    cert: bytes | None
    key: bytes | None
    context: ssl.SSLContext

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def tls_material(ca, cert, key) -> TlsMaterial | None:
    """TLS settings from bytes or file paths; None for a plaintext client.

    ValueError naming the argument when a file is unreadable, holds no PEM
    certificate or key, or the key is not the certificate's.
    """
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together (a client certificate for mutual TLS)")
    ca_pem, cert_pem, key_pem = _pem(ca, "tls_ca"), _pem(cert, "tls_cert"), _pem(key, "tls_key")
    return TlsMaterial(ca_pem, cert_pem, key_pem, _ssl_context(ca_pem, cert_pem, key_pem))


def _ssl_context(ca: bytes | None, cert: bytes | None, key: bytes | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the name, as gRPC does
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            raise ValueError(f"tls_ca holds no PEM certificate ({exc})") from None
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cert is not None and key is not None:
        # ssl loads a certificate chain from files only: a private directory, gone right after.
        with tempfile.TemporaryDirectory(prefix="ps-client-tls-") as directory:
            paths = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
            for path, data in zip(paths, (cert, key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
            try:
                context.load_cert_chain(*paths, password=lambda: b"")  # never a terminal prompt
            except ssl.SSLError as exc:
                raise ValueError(f"tls_cert and tls_key: not a PEM certificate and the unencrypted private "
                                 f"key it was issued for ({exc})") from None
    context.set_alpn_protocols(["h2"])
    return context


class BearerToken:
    """The bearer token every call presents: given, or read from a file.

    A token from a file is read when the client is built and again by
    :meth:`reread`, which the client calls when a server refuses the token
    (a rotated ``--auth-token-file``): calls and streams opened afterwards
    present what the file holds then. Thread-safe.
    """

    def __init__(self, token: str | None, path: str | None) -> None:
        if token is not None and path is not None:
            raise ValueError("give auth_token or auth_token_file, not both")
        self.path = path
        # Serialises rereads (writes of _token and _metadata); every call reads
        # _metadata, one attribute read of an immutable tuple, without it.
        self._lock = threading.Lock()
        self._token = self._read() if path is not None else token
        self._metadata = self._metadata_of(self._token)

    @staticmethod
    def _metadata_of(token: str | None) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {token}"),) if token else None

    def _read(self) -> str:
        assert self.path is not None
        try:
            with open(self.path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"auth_token_file: cannot read {self.path!r}: {exc}") from None
        if not token:
            raise ValueError(f"auth_token_file {self.path!r} is empty")
        return token

    @property
    def from_file(self) -> bool:
        return self.path is not None

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The call metadata carrying the current token (None without a token)."""
        return self._metadata

    def value(self) -> str:
        """The current token ('' without one): what a TCP lane's hello presents."""
        return self._token or ""

    def reread(self) -> bool:
        """Read the file again; True when it now holds a different token.

        False for a token given directly, and when the file is unreadable or
        empty (mid-rewrite): the last token read is kept.
        """
        if self.path is None:
            return False
        try:
            token = self._read()
        except ValueError:
            return False
        with self._lock:
            changed = token != self._token
            self._token, self._metadata = token, self._metadata_of(token)
        return changed
