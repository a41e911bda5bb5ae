"""Requests in domain terms: what the servicer submits, what it receives back, and its handle on them.

The servicer builds a `GenerationRequest` from the proto; validation.py checks it; the scheduler queues
it and, after each step, hands the request an `Emission` through its `emit` callback. `RequestHandle` is
the caller's side of a submitted request (cancel it from any thread). A failure is a `SchedulerError`
of one `ErrorKind`, which serving_common.errors maps to a status. No JAX here.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_service.constraint import Constraint
from model_service.sampling_settings import GREEDY, SamplingSettings
from serving_common.failures import DomainError, ErrorKind
from serving_common.randomness import random_bits

log = logging.getLogger(__name__)


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    CONTEXT_LENGTH = "context_length"
    STOP_TOKEN = "stop_token"  # one of the request's stop_token_ids (included in the tokens)


class SchedulerError(DomainError):
    """A request's failure; an INVALID_ARGUMENT's message starts with `field: ` (validation.py)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(kind, message)


@dataclass(frozen=True)
class GenerationRequest:
    """One request in domain terms (the servicer builds it from the proto)."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingSettings = GREEDY  # how each token is drawn (sampling_settings.py)
    seed: int | None = None  # None: a random one
    max_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    deadline: float | None = None  # time.monotonic() value
    # Samples of the prompt, sharing one prefill, each in its own slot; sample i uses seed + i (mod 2**32), as
    # vLLM derives them, so sample i equals a request with that seed (n = 1 is exactly a plain request).
    n: int = 1
    prompt_logprobs: int | None = None  # score the prompt's tokens, with this many alternatives each (0..20)
    constraint: Constraint | None = None  # structured output: what the text must match (structured.py)
    # Prefix-cache isolation: the prompt's blocks are keyed under this salt (kv_blocks.py), so only requests with
    # the same salt share them. The gateway's digest of the caller's API key and cache_salt; b"": unsalted.
    cache_salt: bytes = b""


@dataclass(frozen=True)
class TokenOut:
    id: int
    prob: float
    top: tuple[tuple[int, float], ...]  # (id, probability), most probable first


@dataclass(frozen=True)
class Timings:
    queue_seconds: float
    prefill_seconds: float
    mean_step_seconds: float
    draft_tokens: int = 0  # speculative decoding: draft tokens verified for the sample
    accepted_draft_tokens: int = 0  # of those, tokens that counted

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class Emission:
    """What a request receives after a step: its new tokens, and on the last one why it ended."""

    tokens: tuple[TokenOut, ...]
    completion_tokens: int
    prompt_tokens: int
    finish_reason: FinishReason | None = None
    error: SchedulerError | None = None
    timings: Timings | None = None
    index: int = 0  # which of the request's n samples (tokens, counts and finish are per sample)
    prompt: tuple[TokenOut, ...] | None = None  # prompt tokens 1..n-1 scored (first emission, when asked for)


EmitFn = Callable[[Emission], None]


def cancelled_error() -> SchedulerError:
    return SchedulerError(ErrorKind.CANCELLED, "the request was cancelled by the client")


def deadline_error() -> SchedulerError:
    return SchedulerError(ErrorKind.DEADLINE_EXCEEDED, "the request's deadline passed")


def kv_full_error(tokens: int, pool_tokens: int) -> SchedulerError:
    """A sample that alone outgrew the KV pool (nothing else left to preempt; its request's other samples wait
    for it). Its length was not certain at admission (it could have ended earlier), else validation refused it."""
    return SchedulerError(ErrorKind.RESOURCE_EXHAUSTED, f"one sample of this request reached {tokens} tokens and the "
                          f"KV memory holds {pool_tokens}: ask for fewer tokens (max_tokens), or start the service "
                          "with more --kv-tokens")


class RequestHandle:
    """The caller's side of a submitted request: cancel it from any thread."""

    def __init__(self, request: GenerationRequest, emit: EmitFn,
                 on_cancel: Callable[["RequestHandle"], None], steps: Callable[[], int]) -> None:
        self.request = request
        self._emit = emit
        self._on_cancel = on_cancel
        self._steps = steps  # the scheduler's step count
        self._cancelled = threading.Event()
        self.done = threading.Event()
        self.enqueued_at = time.monotonic()
        self.cancelled_at: float | None = None
        self.cancel_step = 0  # the scheduler's step count when cancel() was called
        self._open = request.n  # samples not finished yet
        self.grammar: Any = None  # the constraint compiled by the scheduler at submit (structured.Compiled)
        # Kept across a preemption, so the recomputed request draws the same tokens and delivers none twice:
        self.seed: int | None = None  # the seed its first admission drew with
        self.delivered: dict[int, list[int]] = {}  # sample index -> token ids delivered so far
        self.finished_samples: set[int] = set()

    def draw_seed(self) -> int:
        """The request's seed; one drawn at random is kept, so a preempted request draws the same tokens again."""
        if self.seed is None:
            self.seed = self.request.seed if self.request.seed is not None else random_bits(32)
        return self.seed

    def cancel(self) -> None:
        """Leave the waiting queue at once, or free the slot at the next step boundary (no-op once done)."""
        if not self.done.is_set() and not self._cancelled.is_set():
            self.cancelled_at = time.monotonic()
            self.cancel_step = self._steps()  # before the decode thread can see the cancel
            self._cancelled.set()
            self._on_cancel(self)

    def abandon(self, error: SchedulerError) -> None:
        """End the request with `error` now, from any thread; the decode loop frees its slot later."""
        self._cancelled.set()
        if not self.done.is_set():
            self.emit(Emission((), 0, len(self.request.prompt), error=error))

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self, now: float) -> bool:
        return self.request.deadline is not None and now >= self.request.deadline

    def abandoned(self, now: float) -> SchedulerError | None:
        """Why the request must end now (past its deadline, or cancelled), or None."""
        # The deadline first: when it passes, gRPC also cancels the call, but the cause is the deadline.
        if self.expired(now):
            return deadline_error()
        if self.cancelled:
            return cancelled_error()
        return None

    def fail(self, error: SchedulerError, completion_tokens: int = 0) -> None:
        """End the request with `error` unless it already ended."""
        if not self.done.is_set():
            self.emit(Emission((), completion_tokens, len(self.request.prompt), error=error))

    def emit(self, emission: Emission) -> None:
        if emission.finish_reason is not None:
            self._open -= 1
        if emission.error is not None or self._open <= 0:
            self.done.set()
            if emission.error is not None:
                self._cancelled.set()  # the request failed: its other samples' slots are freed too
        try:
            self._emit(emission)
        except Exception:  # a broken consumer must not take the decode thread down
            log.exception("emit failed", extra={"request_id": self.request.request_id})


def engine_failure(error: Exception, message: str) -> SchedulerError:
    """An engine may raise a SchedulerError to choose the status (e.g. UNAVAILABLE when it can no longer run);
    anything else is INTERNAL with `message`."""
    return error if isinstance(error, SchedulerError) else SchedulerError(ErrorKind.INTERNAL, message)
