"""TLS credentials and bearer tokens for the client's channels."""

from __future__ import annotations

import grpc

__all__ = ["channel_credentials", "read_token"]


def _pem(value: str | bytes | None, argument: str) -> bytes | None:
    """PEM bytes from bytes or a file path."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{argument}: cannot read {value!r}: {exc}") from None


def channel_credentials(ca, cert, key) -> grpc.ChannelCredentials | None:
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together (a client certificate for mutual TLS)")
    return grpc.ssl_channel_credentials(root_certificates=_pem(ca, "tls_ca"), private_key=_pem(key, "tls_key"),
                                        certificate_chain=_pem(cert, "tls_cert"))


def read_token(token: str | None, path: str | None) -> str | None:
    if token is not None and path is not None:
        raise ValueError("give auth_token or auth_token_file, not both")
    if path is not None:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"auth_token_file: cannot read {path!r}: {exc}") from None
        if not token:
            raise ValueError(f"auth_token_file {path!r} is empty")
    return token
