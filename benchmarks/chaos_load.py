"""Traffic for a chaos run and the fault tests: request kinds, worker threads, outcome accounting.

Kinds: `complete` (seeded requests whose text must equal what the same request returned on a calm
stack: batching, kills and restarts must not change a seeded answer), `cancel` (a stream cancelled
after 0-300 ms), `deadline` (a deadline shorter than the request), `fuzz` (one field out of range),
`burst` (many simultaneous long requests). Each call ends in one outcome: a gRPC status name, or
WRONG_OUTPUT. EXPECTED says which outcomes each kind may have; anything else is a finding. Workers
back off as the server's RetryInfo says after RESOURCE_EXHAUSTED / UNAVAILABLE (a client that retried
at once would only measure how fast refusals are).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gateway.client import completion_request, generate_request
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from serving_common.errors import details_of
from serving_common.limits import MAX_TOP_LOGPROBS

BUSY_OR_DOWN = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}  # allowed for every kind while the stack is attacked
EXPECTED = {
    "complete": {"OK"} | BUSY_OR_DOWN,
    "cancel": {"CANCELLED", "OK"} | BUSY_OR_DOWN,
    "deadline": {"DEADLINE_EXCEEDED", "OK"} | BUSY_OR_DOWN,
    "fuzz": {"INVALID_ARGUMENT"} | BUSY_OR_DOWN,
    "burst": {"OK"} | BUSY_OR_DOWN,
}
SEEDED_PROMPTS = ("The answer to life", "Once upon a time", "Grok-1 is a mixture of experts", "In the beginning")


@dataclass(frozen=True)
class Seeded:
    """A reproducible request and the text it must produce."""

    prompt: str
    seed: int
    expected: str = ""

    def request(self, max_tokens: int = 12) -> gateway_pb2.CompleteRequest:
        return completion_request(self.prompt, max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=self.seed,
                                  ignore_eos=True)


def baseline(address: str, count: int = 4) -> list[Seeded]:
    """Seeded requests with the text each returns on the calm stack."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for i in range(count):
            seeded = Seeded(SEEDED_PROMPTS[i % len(SEEDED_PROMPTS)], 1000 + i)
            out.append(Seeded(seeded.prompt, seeded.seed, stub.Complete(seeded.request(), timeout=120).text))
    return out


@dataclass
class Outcomes:
    """Thread-safe counts of (kind, outcome)."""

    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.counts[(kind, outcome)] += 1

    def snapshot(self) -> collections.Counter[tuple[str, str]]:
        with self.lock:
            return collections.Counter(self.counts)

    def unexpected(self) -> dict[str, int]:
        return {f"{k}:{o}": n for (k, o), n in self.snapshot().items() if o not in EXPECTED[k]}

    def table(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.snapshot().items()):
            out.setdefault(kind, {})[outcome] = n
        return out


def _code(error: grpc.RpcError) -> str:
    code = error.code()
    return code.name if code is not None else "UNKNOWN"


def backoff(error: grpc.RpcError) -> float:
    """How long a polite client waits after a refusal: the server's RetryInfo, at most 1 s."""
    if error.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        return 0.0
    retry = details_of(error).retry_after
    return min(retry if retry is not None else 0.2, 1.0)


class Caller:
    """One worker's channel and the calls of each kind; `wait` is the backoff the last refusal asked for."""

    def __init__(self, address: str, seeded: Sequence[Seeded], rng: random.Random, long_tokens: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.seeded = seeded
        self.rng = rng
        self.long_tokens = long_tokens
        self.wait = 0.0

    def failed(self, error: grpc.RpcError) -> str:
        self.wait = backoff(error)
        return _code(error)

    def complete(self) -> str:
        case = self.rng.choice(self.seeded)
        try:
            text = self.stub.Complete(case.request(), timeout=120).text
        except grpc.RpcError as error:
            return self.failed(error)
        return "OK" if text == case.expected else "WRONG_OUTPUT"

    def cancel(self) -> str:
        request = generate_request(self.rng.choice(SEEDED_PROMPTS), max_tokens=self.long_tokens, ignore_eos=True,
                                   temperature=1.0)
        call = self.stub.Generate(request, timeout=120)
        timer = threading.Timer(self.rng.uniform(0.0, 0.3), call.cancel)
        timer.start()
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            return self.failed(error)
        finally:
            timer.cancel()
        return "OK"

    def deadline(self) -> str:
        request = completion_request(self.rng.choice(SEEDED_PROMPTS), max_tokens=self.long_tokens, ignore_eos=True)
        try:
            self.stub.Complete(request, timeout=self.rng.uniform(0.02, 0.3))
        except grpc.RpcError as error:
            return self.failed(error)
        return "OK"

    def fuzz(self) -> str:
        time.sleep(0.02)  # refusals are instant: keep them from drowning the other kinds in the counts
        request = completion_request("fuzz", max_tokens=4)
        sampling = request.sampling
        broken = self.rng.choice(["prompt", "max_tokens", "temperature", "top_p", "top_logprobs", "stop",
                                  "blocked_token_ids"])
        if broken == "prompt":
            request.prompt = ""
        elif broken == "max_tokens":
            sampling.max_tokens = self.rng.choice([0, -1, 10**9])
        elif broken == "temperature":
            sampling.temperature = self.rng.choice([-1.0, float("nan"), float("inf")])
        elif broken == "top_p":
            sampling.top_p = self.rng.choice([0.0, 1.5, float("nan")])
        elif broken == "top_logprobs":
            sampling.top_logprobs = self.rng.choice([-1, MAX_TOP_LOGPROBS + 1, 2**31 - 1])
        elif broken == "stop":
            sampling.stop.extend([""])
        else:
            sampling.blocked_token_ids.extend([-5])
        try:
            self.stub.Complete(request, timeout=60)
        except grpc.RpcError as error:
            return self.failed(error)
        return "OK"

    def close(self) -> None:
        self.channel.close()


class Traffic:
    """Worker threads sending requests of their kind in a loop until `stop()`."""

    def __init__(self, address: str, seeded: Sequence[Seeded], workers: dict[str, int], long_tokens: int,
                 seed: int = 0, pause: float = 0.0) -> None:
        self.address = address
        self.seeded = seeded
        self.workers = workers
        self.long_tokens = long_tokens
        self.seed = seed
        self.pause = pause
        self.outcomes = Outcomes()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "Traffic":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> "Traffic":
        for kind, count in self.workers.items():
            for i in range(count):
                rng = random.Random(f"{self.seed}-{kind}-{i}")
                thread = threading.Thread(target=self._run, args=(kind, rng), name=f"{kind}{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def _run(self, kind: str, rng: random.Random) -> None:
        caller = Caller(self.address, self.seeded, rng, self.long_tokens)
        call: Callable[[], str] = getattr(caller, kind)
        try:
            while not self._stop.is_set():
                caller.wait = 0.0
                self.outcomes.add(kind, call())
                if caller.wait or self.pause:
                    self._stop.wait(caller.wait or self.pause)
        finally:
            caller.close()

    def stop(self, timeout: float = 150.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)


def burst(address: str, count: int, long_tokens: int,
          errors: list[grpc.RpcError] | None = None) -> collections.Counter[str]:
    """`count` long requests released at the same instant; their outcomes (failed calls go to `errors`)."""
    gate = threading.Barrier(count)
    results: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def one(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = completion_request(SEEDED_PROMPTS[i % len(SEEDED_PROMPTS)], max_tokens=long_tokens,
                                         ignore_eos=True)
            grpc.channel_ready_future(channel).result(timeout=30)
            gate.wait(30)
            try:
                reply = stub.Complete(request, timeout=120)
                outcome = "OK" if reply.usage.completion_tokens == long_tokens else "WRONG_OUTPUT"
            except grpc.RpcError as error:
                outcome = _code(error)
                if errors is not None:
                    errors.append(error)
        with lock:
            results[outcome] += 1

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return results


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.05) -> float | None:
    """Seconds until `predicate()` held, or None if it did not within `timeout`."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return time.monotonic() - began
        time.sleep(step)
    return None
