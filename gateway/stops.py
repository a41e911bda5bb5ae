"""Stop sequences on text across token boundaries, and when a token's text may be released.

The completion text grows token by token. Text that could still turn out to be the start of a stop
sequence is held back (with the tokens that produced it) until it cannot; once a stop sequence
appears, the text before it (or up to its end, when asked to include it) is released and generation
ends. Release happens at token granularity so that each released message's text is exactly the
concatenation of its tokens' texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from grok.gateway.v1 import gateway_pb2


@dataclass
class Release:
    """Tokens (and their text) that may be sent now; `stopped` when a stop sequence ended the text."""

    tokens: list[gateway_pb2.Token] = field(default_factory=list)
    stopped: bool = False
    extra: str = ""  # text without a token (only a final flush after every token was released)
    used: int = 0  # how many of the tokens fed are the completion's: all, or up to the one completing a stop

    @property
    def text(self) -> str:
        return "".join(token.text for token in self.tokens) + self.extra


def holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop sequence."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


def find_stop(text: str, stops: Sequence[str], start: int) -> int:
    """Smallest index >= start where a stop sequence begins in `text`, or -1."""
    found = -1
    for stop in stops:
        index = text.find(stop, start)
        if index >= 0 and (found < 0 or index < found):
            found = index
    return found


class StopMatcher:
    """Feeds tokens with their text; says which tokens are final and whether a stop sequence was hit."""

    def __init__(self, stops: Sequence[str], include: bool = False, min_tokens: int = 0,
                 turn_starts: Sequence[str] = ()) -> None:
        # `turn_starts`: where a chat template's next turn begins (gateway.chat_template); they end the text as the
        # request's stops do, but are never part of it (the next turn is not the answer's)
        self.stops = (*stops, *(s for s in turn_starts if s not in stops))
        self.hidden = frozenset(turn_starts) - frozenset(stops)
        self.include = include  # the matched stop sequence ends the text (vLLM's include_stop_str_in_output)
        # vLLM's min_tokens: a stop sequence ends the text only once it is completed by a token after this many
        self.min_tokens = min_tokens
        self.fed = 0  # tokens fed so far
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the whole completion text so far, held-back part included
        self.pending: list[tuple[gateway_pb2.Token, int]] = []  # token, char offset where its text starts
        self.stopped = False
        self.matched = ""  # the stop sequence that ended the completion

    def feed(self, tokens: Sequence[gateway_pb2.Token]) -> Release:
        """Add tokens (their `.text` set) and release what can no longer be part of a stop sequence. Tokens are
        matched one at a time, so several fed together stop where they would have arriving one by one; the
        tokens after the one completing a stop are not the completion's (`Release.used`)."""
        if self.stopped:
            raise RuntimeError("feed() after a stop sequence ended the completion")
        for used, token in enumerate(tokens, 1):
            previous = len(self.text)
            self.pending.append((token, previous))
            self.text += token.text
            self.fed += 1
            cut = self._find_stop(previous)
            if cut >= 0:
                release = self._stop_at(cut)
                release.used = used
                return release
        release = self._release_upto(len(self.text) - holdback(self.text, self.stops))
        release.used = len(tokens)
        return release

    def finish(self, tail: str = "") -> Release:
        """The stream ended: add `tail` (the detokenizer's flush) to the last token and release everything."""
        if self.stopped:
            raise RuntimeError("finish() after a stop sequence ended the completion")
        if not tail:
            return self._release_upto(len(self.text), final=True)
        start = len(self.text)
        self.text += tail
        cut = self._find_stop(start)
        if self.pending:
            self.pending[-1][0].text += tail
            return self._stop_at(cut) if cut >= 0 else self._release_upto(len(self.text), final=True)
        # Every token was released already (nothing was held back, so no stop starts before `start`):
        # the flushed text has no token of its own.
        end = cut if cut >= 0 else len(self.text)
        self.stopped = cut >= 0
        if self.stopped:
            self._match(cut)
            end = self._end(cut)
        return Release([], stopped=self.stopped, extra=self.text[start:end])

    def _find_stop(self, added: int) -> int:
        """Where a stop sequence completed by the text from `added` on begins, or -1 (also while the first
        `min_tokens` tokens are fed)."""
        if not self.stops or self.fed <= self.min_tokens:
            return -1
        return find_stop(self.text, self.stops, max(0, added - self.longest + 1))

    def _release_upto(self, safe: int, final: bool = False) -> Release:
        """Release tokens whose text ends by `safe`; trailing empty-text tokens wait (unless `final`)
        because their bytes may still become text, which the detokenizer's flush attributes to them."""
        released: list[gateway_pb2.Token] = []
        with_text = [i for i, (token, _) in enumerate(self.pending) if token.text]
        count = len(self.pending) if final else (with_text[-1] + 1 if with_text else 0)
        while self.pending and len(released) < count:
            token, start = self.pending[0]
            if start + len(token.text) > safe:
                break
            released.append(token)
            self.pending.pop(0)
        return Release(released)

    def _match(self, cut: int) -> None:
        """Remember which stop sequence begins at `cut` (the first listed, when several do)."""
        self.matched = next(s for s in self.stops if self.text.startswith(s, cut))

    def _end(self, cut: int) -> int:
        """Where the text ends when the stop sequence matched at `cut` ends it: before it, or after it with
        `include`."""
        return cut + len(self.matched) if self.include and self.matched not in self.hidden else cut

    def _stop_at(self, cut: int) -> Release:
        """Release the tokens that contributed text before the end (`_end`), the last one trimmed; drop the
        rest."""
        self._match(cut)
        cut = self._end(cut)
        released: list[gateway_pb2.Token] = []
        for token, start in self.pending:
            end = start + len(token.text)
            if start < cut:
                if end > cut:
                    token.text = token.text[: cut - start]
                released.append(token)
        self.pending.clear()
        self.text = self.text[:cut]
        self.stopped = True
        return Release(released, stopped=True)
