"""A tiny DNS server for tests: answers A queries for a fixed table, like compose's embedded DNS.

Compose gives every replica of a scaled service its own address under the service's name; gRPC's
`dns://SERVER/name:port` target asks a chosen DNS server, so a test can point the gateway at this
one and serve `model` as 127.0.0.1 and 127.0.0.2, two replicas on the same port.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Mapping, Sequence

TYPE_A = 1
CLASS_IN = 1
TTL_SECONDS = 1


def parse_question(packet: bytes) -> tuple[int, str, int, bytes]:
    """(query id, lower-case name, query type, the question section verbatim)."""
    query_id = struct.unpack(">H", packet[:2])[0]
    labels, i = [], 12
    while packet[i]:
        length = packet[i]
        labels.append(packet[i + 1:i + 1 + length].decode("ascii", "replace"))
        i += 1 + length
    qtype = struct.unpack(">H", packet[i + 1:i + 3])[0]
    return query_id, ".".join(labels).lower(), qtype, packet[12:i + 5]


def answer(packet: bytes, table: Mapping[str, Sequence[str]]) -> bytes:
    """The response to one query: the table's A records, no records for other types, NXDOMAIN if unknown."""
    query_id, name, qtype, question = parse_question(packet)
    known = name in table
    ips = list(table[name]) if known and qtype == TYPE_A else []
    flags = 0x8180 | (0 if known else 3)  # response, recursion desired+available; rcode NXDOMAIN
    header = struct.pack(">HHHHHH", query_id, flags, 1, len(ips), 0, 0)
    records = b"".join(b"\xc0\x0c" + struct.pack(">HHIH", TYPE_A, CLASS_IN, TTL_SECONDS, 4) + socket.inet_aton(ip)
                       for ip in ips)
    return header + question + records


class DnsServer:
    """Serves `table` (name -> IPv4 addresses) over UDP on 127.0.0.1 from a daemon thread."""

    def __init__(self, table: Mapping[str, Sequence[str]]) -> None:
        self.table = {k.lower(): tuple(v) for k, v in table.items()}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.queries: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                packet, peer = self.sock.recvfrom(512)
            except OSError:
                return  # closed
            try:
                self.queries.append(parse_question(packet)[1:3])
                self.sock.sendto(answer(packet, self.table), peer)
            except (IndexError, struct.error, OSError):
                continue  # a malformed packet gets no answer, as from a real server

    def close(self) -> None:
        self.sock.close()
