"""TLS for the stack's ports: server credentials (optionally requiring client certificates) and
channel credentials (optionally presenting one), read from PEM files named by flags.

A server with `ServerTLS(cert, key)` speaks TLS; adding `client_ca` makes it mutual: a client must
present a certificate signed by that CA or the handshake fails. A channel with `ChannelTLS(ca)`
verifies the server against `ca`; adding `cert`/`key` presents the client certificate mTLS asks for.
Files are read once at start-up, so a missing or unreadable file stops the service with a message
naming the flag instead of failing the first handshake.
"""

from __future__ import annotations

import argparse
import pathlib
import ssl
from dataclasses import dataclass

import grpc

from serving_common.flags import EnvArgumentParser
from serving_common.grpc_server import bind, bind_error
from serving_common.uds import SocketFile, check_free, owner_only, target


def read_pem(path: str, flag: str) -> bytes:
    """The file's bytes; ValueError naming `flag` when it cannot be read or holds no PEM block."""
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path!r} ({error.strerror or error})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path!r} is not a PEM file (expected '-----BEGIN ...')")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and key (PEM paths); `client_ca` set: clients need a certificate."""

    cert: str
    key: str
    client_ca: str | None = None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        pair = (read_pem(self.key, "--tls-key"), read_pem(self.cert, "--tls-cert"))
        ca = read_pem(self.client_ca, "--tls-ca") if self.client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The same settings for an HTTP server (uvicorn)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        read_pem(self.cert, "--tls-cert")
        read_pem(self.key, "--tls-key")
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            context.load_verify_locations(cafile=self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclass(frozen=True)
class ChannelTLS:
    """How a client verifies a server (`ca`), and its own certificate for mutual TLS (`cert`/`key`).

    `server_name` overrides the name checked against the server's certificate (when the address is
    an IP or a name the certificate does not list).
    """

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-client-cert and --tls-client-key go together (the gateway's client certificate)")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        key = read_pem(self.key, "--tls-client-key") if self.key else None
        cert = read_pem(self.cert, "--tls-client-cert") if self.cert else None
        return grpc.ssl_channel_credentials(read_pem(self.ca, "--tls-ca"), private_key=key, certificate_chain=cert)

    def channel_options(self) -> tuple[tuple[str, object], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()


def server_tls(cert: str | None, key: str | None, client_ca: str | None = None) -> ServerTLS | None:
    """ServerTLS from the --tls-cert/--tls-key/--tls-ca flags (None when TLS is off); checks they go together."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: client certificates are checked only over TLS")
        return None
    if not cert or not key:
        raise ValueError("--tls-cert and --tls-key go together (the server's certificate chain and private key)")
    tls = ServerTLS(cert, key, client_ca or None)
    tls.grpc_credentials()  # fail at start-up, naming the flag, if a file is unreadable
    check_key_pair(cert, key)
    return tls


def check_key_pair(cert: str, key: str) -> None:
    """ValueError naming both flags when `key` is not the private key of `cert` (or either is unusable).

    gRPC only finds out when it binds the port, and then reports the port as in use."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as error:
        if "KEY_VALUES_MISMATCH" in str(error):
            raise ValueError(f"--tls-key: {key!r} does not match the certificate of --tls-cert {cert!r}: "
                             "give the private key that belongs to that certificate") from None
        raise ValueError(f"--tls-cert/--tls-key: {cert!r} and {key!r} are not a usable certificate and key "
                         f"({error.reason or error})") from None


def bind_port(server: grpc.aio.Server, host: str, port: int, tls: ServerTLS | None, uds: str | None = None) -> int:
    """Bind `host:port`, with TLS when `tls` is set; the port actually bound (port 0 picks a free one).

    `uds`: bind that unix socket file instead (serving_common.uds: never over an existing file, owner-only,
    removed at exit) and return 0."""
    if uds is not None:
        bind_socket_file(server, uds, tls)
        return 0
    if tls is None:
        return bind(server, host, port)
    try:
        bound = server.add_secure_port(f"{host}:{port}", tls.grpc_credentials())
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise bind_error(host, port)
    return bound


def bind_socket_file(server: grpc.aio.Server, path: str, tls: ServerTLS | None, flag: str = "--uds") -> SocketFile:
    """Bind the unix socket `path` (checked first: gRPC itself would replace any socket there)."""
    check_free(path, flag)
    credentials = tls.grpc_credentials() if tls is not None else None
    try:
        with owner_only():
            if credentials is None:
                server.add_insecure_port(target(path))
            else:
                server.add_secure_port(target(path), credentials)
    except RuntimeError:
        raise OSError(f"{flag}: could not bind {path!r}") from None
    return SocketFile.created(path)


def secure_channel(address: str, tls: ChannelTLS | None,
                   options: tuple[tuple[str, object], ...] = ()) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS (and mTLS) when `tls` is set, plaintext otherwise."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.grpc_credentials(), options=(*options, *tls.channel_options()))


def add_server_flags(parser: EnvArgumentParser) -> None:
    """--tls-cert/--tls-key/--tls-ca of an internal service (tokenizer, model)."""
    parser.add_env_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    parser.add_env_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_env_argument("--tls-ca", default=None,
                            help="PEM CA certificate: require client certificates signed by it (mutual TLS)")


def server_tls_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerTLS | None:
    """The ServerTLS of add_server_flags' flags; a bad combination or file is a usage error."""
    try:
        return server_tls(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as error:
        parser.error(str(error))
        raise
