"""The decode loop's structured-output part: what scheduler.py does for a request with a constraint.

Before submit the servicer awaits `Guidance.compile_async` (structured.GrammarCompiler: checked in a worker
process, built on a compile thread, cached), so neither the event loop nor the decode thread ever compiles;
a constraint that cannot be served is refused with INVALID_ARGUMENT naming the field before a slot is taken
(RESOURCE_EXHAUSTED when too many wait to compile). Each sample then holds its own `Guide`; every step in
which it draws, the loop sends its mask in the step's batch (StepBatch.masks): `next_mask`, the guide's mask AND the request's allowed/blocked/pad mask, checked on
the host to allow at least one id (else the sampler would draw the pad id from all-masked logits). A per-step
limit of the library, or a step where nothing is left, ends that request only, with INVALID_ARGUMENT naming
the field. No JAX here.
"""

from __future__ import annotations

import logging

import numpy as np

from model_service.constraint import Constraint
from model_service.engine_api import EngineLike
from model_service.loop_state import Running
from model_service.requests import ErrorKind, GenerationRequest, RequestHandle, SchedulerError
from model_service.sampling_settings import SamplingSettings, build_mask
from model_service.structured import (
    CompilerBusy,
    CompilerUnavailable,
    Compiled,
    ConstraintError,
    GrammarCompiler,
    Guide,
    StepLimit,
)

log = logging.getLogger(__name__)


class Guidance:
    """Compiles constraints for the scheduler and gives constrained samples their guides and masks."""

    def __init__(self, engine: EngineLike, grammars: GrammarCompiler | None) -> None:
        self.engine = engine
        self.grammars = grammars  # structured output needs a compiler (the tokenizer's pieces)

    def compile(self, request: GenerationRequest) -> Compiled | None:
        """The request's constraint compiled, None without one (blocks the calling thread while it compiles);
        INVALID_ARGUMENT naming the field when it is invalid, too big, or leaves no token to start with."""
        c = self._served(request)
        if c is None:
            return None
        try:
            compiled = self.grammars.compile(c)  # type: ignore[union-attr]
        except REFUSALS as e:
            raise refusal(e) from None
        return self._admissible(request, compiled)

    async def compile_async(self, request: GenerationRequest) -> Compiled | None:
        """`compile` off the event loop and off the decode thread: what the servicer awaits before
        `Scheduler.submit`."""
        c = self._served(request)
        if c is None:
            return None
        try:
            compiled = await self.grammars.compile_async(c)  # type: ignore[union-attr]
        except REFUSALS as e:
            raise refusal(e) from None
        return self._admissible(request, compiled)

    def _served(self, request: GenerationRequest) -> Constraint | None:
        c = request.constraint
        if c is None:
            return None
        if self.grammars is None:
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{c.field}: this model service was started without "
                                 "structured output (model_service --tokenizer, the model's SentencePiece file)")
        return c

    def _admissible(self, request: GenerationRequest, compiled: Compiled) -> Compiled:
        c = request.constraint
        assert c is not None
        if not (compiled.first_mask & self.base_mask(request.sampling)).any():
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{c.field}: no token can start the output within "
                                 "allowed_token_ids/blocked_token_ids")
        return compiled

    def base_mask(self, s: SamplingSettings) -> np.ndarray:
        return build_mask(self.engine.vocab_size, self.engine.pad_id, s.allowed, s.blocked)

    def attach(self, handle: RequestHandle, act: Running) -> Running:
        """Give a constrained sample its own grammar position and its request's own mask."""
        if handle.grammar is not None:
            act.guide = handle.grammar.guide()
            act.base_mask = self.base_mask(handle.request.sampling)
        return act

    def mask(self, act: Running) -> tuple[np.ndarray | None, SchedulerError | None]:
        """A constrained sample's mask for its next draw (its grammar after the tokens delivered so far), or the
        error ending it (`next_mask`: a per-step limit of the library, or nothing left to draw)."""
        try:
            return next_mask(act.guide, act.base_mask, act.handle.request, act.generated), None
        except SchedulerError as e:
            return None, e

    @staticmethod
    def advance(act: Running, token: int) -> tuple[bool, SchedulerError | None]:
        """Move a constrained sample's grammar past its drawn token: (complete, error)."""
        req = act.handle.request
        try:
            act.guide.advance(token)
        except StepLimit as e:  # the library gave up on an allowed token: the constraint's limit, not a bug
            log.info("structured output gave up", extra={"request_id": req.request_id, "detail": str(e)})
            return True, too_complex(req, act.generated, str(e))
        except Exception:  # the device drew a token its mask forbade, or the library broke: never the request's fault
            log.exception("grammar rejected a drawn token", extra={"request_id": req.request_id})
            return True, SchedulerError(ErrorKind.INTERNAL, f"structured output failed (request {req.request_id})")
        return bool(act.guide.finished), None


def next_mask(guide: Guide, base_mask: np.ndarray, request: GenerationRequest, generated: int) -> np.ndarray:
    """[V] bool: the ids the next step may draw (the grammar's AND the request's own mask), on the host.
    SchedulerError (INVALID_ARGUMENT naming the field) when the library cannot compute it, or when it
    leaves no id at all: the sampler must never see all-masked logits (it would draw the pad id)."""
    field = request.constraint.field if request.constraint is not None else "constraint"
    try:
        mask = guide.mask() & base_mask
    except StepLimit as e:
        log.info("structured output gave up", extra={"request_id": request.request_id, "detail": str(e)})
        raise too_complex(request, generated, str(e)) from None
    except Exception:  # anything else the library raises ends this request only, never the decode loop
        log.exception("structured output failed", extra={"request_id": request.request_id})
        raise SchedulerError(ErrorKind.INTERNAL, f"structured output failed (request {request.request_id})") from None
    if not mask.any():
        raise SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{field}: after {generated} tokens nothing the constraint "
                             "allows is within allowed_token_ids/blocked_token_ids; widen them or the constraint")
    return mask


def too_complex(request: GenerationRequest, generated: int, detail: str) -> SchedulerError:
    field = request.constraint.field if request.constraint is not None else "constraint"
    return SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{field}: too complex to follow at token {generated} "
                          f"({detail}); simplify the constraint")


REFUSALS = (ConstraintError, CompilerBusy, CompilerUnavailable)


def refusal(error: Exception) -> SchedulerError:
    """The request's status for a compiler's refusal."""
    if isinstance(error, CompilerBusy):
        return SchedulerError(ErrorKind.RESOURCE_EXHAUSTED, str(error))
    if isinstance(error, CompilerUnavailable):
        return SchedulerError(ErrorKind.UNAVAILABLE, str(error))
    return SchedulerError(ErrorKind.INVALID_ARGUMENT, str(error))
