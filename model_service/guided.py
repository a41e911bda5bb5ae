"""The decode loop's structured-output part: what scheduler.py does for a request with a constraint.

At submit the constraint is compiled (structured.GrammarCompiler, cached) or refused with INVALID_ARGUMENT
naming the field, before the request is queued. The first draw (the prefill's) may only start as the
grammar allows: its settings' `allowed` ids are the grammar's first mask within the request's own mask.
Each sample then holds its own `Guide`; after every token the loop sets the slot's next-step mask on the
device (Engine.set_slot_mask) to the guide's mask AND the request's allowed/blocked/pad mask. No JAX here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from model_service.engine_api import EngineLike
from model_service.loop_state import Running
from model_service.requests import ErrorKind, GenerationRequest, RequestHandle, SchedulerError
from model_service.sampling_settings import SamplingSettings, build_mask
from model_service.structured import Compiled, ConstraintError, GrammarCompiler

log = logging.getLogger(__name__)


class Guidance:
    """Compiles constraints for the scheduler and gives constrained samples their guides and masks."""

    def __init__(self, engine: EngineLike, grammars: GrammarCompiler | None) -> None:
        self.engine = engine
        # Structured output needs a compiler (the tokenizer's pieces) and an engine that can set a slot's mask.
        self.grammars = grammars
        self.masking = hasattr(engine, "set_slot_mask")  # engine_api.MaskingEngine

    def compile(self, request: GenerationRequest) -> Compiled | None:
        """The request's constraint compiled, None without one; INVALID_ARGUMENT naming the field when it is
        invalid, too big, or leaves no token to start with."""
        c = request.constraint
        if c is None:
            return None
        if self.grammars is None:
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{c.field}: this model service was started without "
                                 "structured output (model_service --tokenizer, the model's SentencePiece file)")
        if not self.masking:
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{c.field}: structured output is not served by a "
                                 "multi-process model replica yet; send it to a single-process one")
        try:
            compiled = self.grammars.compile(c)
        except ConstraintError as e:
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, str(e)) from None
        if not (compiled.first_mask & self.base_mask(request.sampling)).any():
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{c.field}: no token can start the output within "
                                 "allowed_token_ids/blocked_token_ids")
        return compiled

    def base_mask(self, s: SamplingSettings) -> np.ndarray:
        return build_mask(self.engine.vocab_size, self.engine.pad_id, s.allowed, s.blocked)

    def first_sampling(self, handle: RequestHandle) -> SamplingSettings:
        """The settings of a request's first draw: a constrained one may only start as its grammar allows."""
        s = handle.request.sampling
        if handle.grammar is None:
            return s
        allowed = handle.grammar.first_mask & self.base_mask(s)
        return dataclasses.replace(s, allowed=tuple(allowed.nonzero()[0].tolist()))

    def attach(self, handle: RequestHandle, act: Running) -> Running:
        """Give a constrained sample its own grammar position and its request's own mask."""
        if handle.grammar is not None:
            act.guide = handle.grammar.guide()
            act.base_mask = self.base_mask(handle.request.sampling)
        return act

    def set_masks(self, state: Any, active: dict[int, Running]) -> tuple[Any, dict[int, SchedulerError]]:
        """Set each constrained slot's mask for the next step (its grammar after the tokens delivered so far).
        Returns the new state and, per slot whose grammar failed (a per-step limit of the library), its error."""
        failed: dict[int, SchedulerError] = {}
        for slot, act in active.items():
            if act.guide is None:
                continue
            try:
                mask = act.guide.mask() & act.base_mask
            except RuntimeError:
                req = act.handle.request
                log.exception("structured output failed", extra={"request_id": req.request_id})
                failed[slot] = SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{req.constraint.field}: too complex to "
                                              f"follow at token {act.generated}; simplify the constraint")
                continue
            state = self.engine.set_slot_mask(state, slot, mask)  # type: ignore[attr-defined]
        return state, failed

    @staticmethod
    def advance(act: Running, token: int) -> tuple[bool, SchedulerError | None]:
        """Move a constrained sample's grammar past its drawn token: (complete, error)."""
        try:
            act.guide.advance(token)
        except RuntimeError:  # the device drew a token its mask forbade: a bug, never the request's fault
            rid = act.handle.request.request_id
            log.exception("grammar rejected a drawn token", extra={"request_id": rid})
            return True, SchedulerError(ErrorKind.INTERNAL, f"structured output failed (request {rid})")
        return bool(act.guide.finished), None
