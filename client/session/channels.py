"""How both clients reach a server: message size options and TLS credentials, built once for either gRPC API."""

from __future__ import annotations

from typing import Any

import grpc


def channel_settings(
    max_message_bytes: int, tls_root_cert: bytes | str | None, tls_server_name: str | None
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """(credentials, options) for `grpc.secure_channel` / `grpc.aio.secure_channel`; no credentials: plaintext.

    `tls_root_cert`: PEM bytes, or a path to them. `tls_server_name`: the name to check the server's
    certificate against when the address is not that name (an IP address, say).
    """
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if tls_root_cert is None:
        return None, options
    if isinstance(tls_root_cert, str):
        with open(tls_root_cert, "rb") as f:
            tls_root_cert = f.read()
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.ssl_channel_credentials(tls_root_cert), options
