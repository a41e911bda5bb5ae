"""Handing a step's token to its request (the `update_from_output` half of the loop, one row at a time).

`Delivery.deliver` reads one row of a prefill's or decode step's output for the request sample holding it:
the token with its alternatives, the finish reason, the grammar's next position for a constrained request,
the emission to the request's stream and the metrics. After a preemption, the tokens a sample delivered
before are recomputed and checked, not delivered again. No JAX and no locks: the decode thread calls it.
"""

from __future__ import annotations

import logging

from model_service.engine_api import EngineLike, StepOutputLike
from model_service.guided import Guidance
from model_service.loop_state import Running, SchedulerMetrics
from model_service.plan import finish_reason, token_out
from model_service.requests import Emission, ErrorKind, FinishReason, SchedulerError, TokenOut

log = logging.getLogger(__name__)


class Delivery:
    """Token delivery for one engine's scheduler."""

    def __init__(self, engine: EngineLike, metrics: SchedulerMetrics, guidance: Guidance) -> None:
        self.engine = engine
        self.metrics = metrics
        self.guidance = guidance

    def deliver(self, act: Running, out: StepOutputLike, row: int, prompt: tuple[TokenOut, ...] | None = None) -> bool:
        """Hand the request its token at `row` of `out` (and its scored prompt, on the first); True when the
        request is finished."""
        req = act.handle.request
        if bool(out.bad[row]):
            log.error("non-finite logits", extra={"request_id": req.request_id})
            act.handle.emit(Emission((), act.generated, len(req.prompt), error=SchedulerError(
                ErrorKind.INTERNAL, f"the model produced non-finite logits (request {req.request_id})")))
            return True
        token = token_out(out, row, req.sampling.top_logprobs)
        act.generated += 1
        if act.generated <= act.skip:  # recomputing after a preemption: delivered before
            return self._replayed(act, token.id)
        act.handle.delivered.setdefault(act.index, []).append(token.id)
        self.metrics.add_tokens(1)
        reason = finish_reason(req, act.generated, token.id, self.engine.eos_id, self.engine.sequence_len)
        if act.guide is not None:
            complete, error = self.guidance.advance(act, token.id)
            if error is not None:
                act.handle.emit(Emission((), act.generated, len(req.prompt), error=error))
                return True
            if complete and reason is None:
                reason = FinishReason.EOS  # the grammar is complete: nothing but EOS could follow
        first_or_last = act.generated == 1 or reason is not None
        act.handle.emit(Emission((token,), act.generated, len(req.prompt), finish_reason=reason,
                                 timings=act.timings() if first_or_last else None, index=act.index, prompt=prompt))
        if reason is not None:
            self.metrics.finished(reason)
            act.handle.finished_samples.add(act.index)
        return reason is not None

    def _replayed(self, act: Running, token: int) -> bool:
        """A token recomputed after a preemption: the grammar moves on, nothing is delivered. It must be the one
        delivered before (batch invariance); if not, the request fails rather than contradict itself."""
        expected = act.handle.delivered[act.index][act.generated - 1]
        if token != expected:
            req = act.handle.request
            log.error("recomputed token differs", extra={"request_id": req.request_id, "expected": expected,
                                                          "got": token})
            act.handle.emit(Emission((), act.skip, len(req.prompt), error=SchedulerError(
                ErrorKind.INTERNAL, f"request {req.request_id} could not be resumed after a preemption; retry")))
            return True
        if act.guide is not None:
            self.guidance.advance(act, token)
        return False
