"""Handing a step's token to its request (the `update_from_output` half of the loop, one row at a time).

`Delivery.deliver` reads one draw of a step's output for the request sample it belongs to: the token with its
alternatives, the finish reason, the grammar's next position for a constrained request, the emission to the
request's stream and the metrics. (After a preemption a sample's delivered tokens are recomputed as known rows,
not drawn again: nothing is delivered twice.) No JAX and no locks: the decode thread calls it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

from model_service.engine_api import EngineLike, StepOutputLike
from model_service.guided import Guidance
from model_service.loop_state import Running, SchedulerMetrics
from model_service.plan import finish_reason, token_out
from model_service.requests import Emission, ErrorKind, FinishReason, RequestHandle, SchedulerError, TokenOut

log = logging.getLogger(__name__)


class Delivery:
    """Token delivery for one engine's scheduler."""

    def __init__(self, engine: EngineLike, metrics: SchedulerMetrics, guidance: Guidance) -> None:
        self.engine = engine
        self.metrics = metrics
        self.guidance = guidance
        self._held: list[tuple[RequestHandle, Emission]] | None = None
        self._counted = 0  # tokens delivered while holding, not yet added to the metrics

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the emissions of a step's delivery and hand them over together at its end: the consumer (the
        servicer's relay) is woken once the step's news is complete, not at its first token, when its thread
        would take the GIL back and forth with this one for the rest of the delivery."""
        self._held = held = []
        try:
            yield
        finally:
            self._held = None
            if self._counted:  # one counter update a step, before anyone hears of its tokens
                self.metrics.add_tokens(self._counted)
                self._counted = 0
            for handle, emission in held:
                handle.emit(emission)

    def _emit(self, handle: RequestHandle, emission: Emission) -> None:
        if self._held is not None:
            self._held.append((handle, emission))
        else:
            handle.emit(emission)

    def deliver(self, act: Running, out: StepOutputLike, rows: int | Sequence[int],
                prompt: tuple[TokenOut, ...] | None = None) -> bool:
        """Hand the request its tokens at `rows` of `out` (one draw, or a speculative step's counted draws, in
        order), in one emission, with its scored prompt on the first; True when the request is finished. A
        finish inside the draws (EOS, a stop id, max_tokens) ends it there: the rest are not delivered."""
        req = act.handle.request
        first = act.generated == 0
        tokens: list[TokenOut] = []
        reason: FinishReason | None = None
        for row in [rows] if isinstance(rows, int) else rows:
            if bool(out.bad[row]):
                log.error("non-finite logits", extra={"request_id": req.request_id})
                return self._fail(act, tokens, act.generated, prompt, SchedulerError(
                    ErrorKind.INTERNAL, f"the model produced non-finite logits (request {req.request_id})"))
            token = token_out(out, row, req.sampling.top_logprobs)
            act.generated += 1
            act.tokens.append(token.id)
            act.handle.delivered.setdefault(act.index, []).append(token.id)
            if self._held is None:
                self.metrics.add_tokens(1)
            else:
                self._counted += 1
            tokens.append(token)
            reason = finish_reason(req, act.generated, token.id, self.engine.eos_id, self.engine.sequence_len)
            if act.guide is not None:
                complete, error = self.guidance.advance(act, token.id)
                if error is not None:
                    return self._fail(act, tokens[:-1], act.generated - 1, prompt, error)
                if complete and reason is None:
                    reason = FinishReason.EOS  # the grammar is complete: nothing but EOS could follow
            if reason is not None:
                break
        self._emit(act.handle, Emission(tuple(tokens), act.generated, len(req.prompt), finish_reason=reason,
                                 timings=act.timings() if first or reason is not None else None, index=act.index,
                                 prompt=prompt))
        if reason is not None:
            self.metrics.finished(reason)
            act.handle.finished_samples.add(act.index)
        return reason is not None

    def _fail(self, act: Running, tokens: list[TokenOut], count: int, prompt: tuple[TokenOut, ...] | None,
              error: SchedulerError) -> bool:
        """The tokens drawn before the failure (`count` in all so far) still go out, then the error ends it."""
        req = act.handle.request
        if tokens:
            self._emit(act.handle, Emission(tuple(tokens), count, len(req.prompt), index=act.index, prompt=prompt))
        self._emit(act.handle, Emission((), act.generated, len(req.prompt), error=error))
        return True
