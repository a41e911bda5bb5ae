"""Speculative decoding that changes no token: n-gram drafts from a request's own tokens, verified in one step.

`--speculative-config` takes vLLM's shape: {"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": N, "prompt_lookup_min": M}. Before a decode step the scheduler looks up the last n tokens of
a sample (n from N down to M) earlier in its prompt and output and proposes the K tokens that followed them
(`propose`). The step then computes the sample's last token and the drafts as consecutive rows and draws from
every one of them; draw j counts only while every earlier draw equalled the draft after it (engine.py:
`accepted_draws`). A row's logits are the same bits alone or beside others (batch invariance), draw j uses the
j-th next key of the sample's schedule and its penalties count the drafts before it, so each counted draw is
the token a step at a time would have drawn: the output is the non-speculative output by construction, greedy
and seeded sampling alike. What speculation buys is fewer steps when drafts are right.

`DraftPacer` keeps a sample whose drafts keep failing, or whose lookups keep finding nothing, from paying for
thrown-away rows and for the loop's wait on its newest token: after a miss it looks for nothing for a while
(longer after each miss in a row). No JAX here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int = 1


def parse_speculative_config(raw: str | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON (None or empty: off); ValueError naming what is wrong."""
    if not raw:
        return None
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config: not JSON ({e.msg}); e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'') from None
    if not isinstance(fields, dict):
        raise ValueError("--speculative-config: want a JSON object")
    unknown = set(fields) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if unknown:
        raise ValueError(f"--speculative-config: unknown field(s) {sorted(unknown)}")
    method = fields.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not served; this service drafts with "
                         f"{', '.join(METHODS)} (a draft model is not built yet)")
    k = fields.get("num_speculative_tokens")
    n_max = fields.get("prompt_lookup_max", 4)
    n_min = fields.get("prompt_lookup_min", 1)
    for name, value in (("num_speculative_tokens", k), ("prompt_lookup_max", n_max), ("prompt_lookup_min", n_min)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--speculative-config: {name} must be an integer >= 1 (got {value!r})")
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--speculative-config: num_speculative_tokens is at most {MAX_SPECULATIVE_TOKENS}")
    if n_min > n_max:
        raise ValueError("--speculative-config: prompt_lookup_min must not exceed prompt_lookup_max")
    return SpeculativeConfig(method, k, n_max, n_min)


def propose(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix (n_max down to n_min
    tokens) of `tokens`; [] when none occurs earlier."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(tokens[size - n:])
        for start in range(size - n - 1, -1, -1):  # latest first: the most recent context is the likeliest
            if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


@dataclass
class DraftPacer:
    """Per sample: whether to look for drafts this step, from how its last lookups and verifications went.

    Drafting has two costs: the rows of drafts that are thrown away, and the step the loop must wait for
    (drafts follow the newest token, so the loop waits for the previous step's draw instead of dispatching
    the next step while the device computes). So a sample whose drafts keep failing, or whose lookups keep
    finding nothing, waits a while before trying again, longer after each miss in a row (up to MAX_WAIT
    steps); a lookup that finds drafts and a verification that keeps one reset it."""

    failures: int = 0  # verifications in a row that kept none of their drafts
    misses: int = 0  # lookups in a row that found nothing to propose
    wait: int = 0  # steps to skip before looking again
    drafted: int = 0  # draft tokens proposed so far
    accepted: int = 0  # of those, tokens that counted

    MAX_WAIT = 64

    def due(self) -> bool:
        """Whether the next call of `ready` is True (no side effect)."""
        return self.wait <= 0

    def ready(self) -> bool:
        """Called once a step while the sample decodes: True when it may look for drafts this step."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def looked_up(self, found: bool) -> None:
        if found:
            self.misses = 0
            return
        self.misses += 1
        self.wait = min(self.MAX_WAIT, 2 ** (self.misses - 1)) if self.misses > 1 else 0

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if drafted and not accepted:
            self.failures += 1
            self.wait = min(self.MAX_WAIT, 2 ** (self.failures - 1)) if self.failures > 1 else 0
        elif accepted:
            self.failures = 0

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None
