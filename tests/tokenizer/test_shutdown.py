"""SIGTERM drains the tokenizer service: health flips, in-flight calls finish, the process exits 0."""

from __future__ import annotations

import pathlib
import queue
import signal
from collections.abc import Iterator

import grpc
import pytest

from grok.tokenizer.v1 import tokenizer_pb2 as pb
from grok.tokenizer.v1 import tokenizer_pb2_grpc
from tests.procs import GROK1_TOKENIZER, Service, free_port
from tests.waiting import wait_until
from tokenizer_service.tokenizer import Tokenizer


def wait_for_log(service: Service, message: str, timeout: float = 10.0) -> None:
    wait_until(lambda: any(r.get("msg") == message for r in service.log_records()), timeout, interval=0.05,
               message=lambda: f"no {message!r} log line:\n{service.logs()[-2000:]}")


def requests_from(source: queue.Queue[pb.DecodeStreamRequest | None]) -> Iterator[pb.DecodeStreamRequest]:
    while (item := source.get(timeout=30)) is not None:
        yield item


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_zero(tmp_path: pathlib.Path,
                                                                 grok_tokenizer: Tokenizer) -> None:
    port = free_port()
    service = Service("tokenizer_service", ["--model", str(GROK1_TOKENIZER), "--host", "127.0.0.1",
                                            "--port", str(port), "--grace-seconds", "30"], port, log_dir=tmp_path)
    try:
        service.wait_serving(timeout=60)
        emoji = [grok_tokenizer.sp.piece_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
        outbox: queue.Queue[pb.DecodeStreamRequest | None] = queue.Queue()
        with grpc.insecure_channel(service.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            stream = stub.DecodeStream(requests_from(outbox), timeout=60)
            outbox.put(pb.DecodeStreamRequest(token_ids=grok_tokenizer.sp.encode("before")))
            assert next(stream).text == "before"

            service.proc.send_signal(signal.SIGTERM)
            wait_for_log(service, "draining")
            assert service.proc.poll() is None  # still draining: the stream is in flight
            with pytest.raises(grpc.RpcError) as refused:
                stub.Encode(pb.EncodeRequest(text="late"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            outbox.put(pb.DecodeStreamRequest(token_ids=emoji[:2]))
            assert next(stream).text == ""
            outbox.put(pb.DecodeStreamRequest(token_ids=emoji[2:] + grok_tokenizer.sp.encode("after")))
            assert next(stream).text == "😀 after"
            outbox.put(None)
            assert list(stream) == []
            assert stream.code() == grpc.StatusCode.OK
        assert service.proc.wait(timeout=30) == 0
        wait_for_log(service, "stopped")
    finally:
        service.kill()
