"""What the benchmark tools' tests check of a time they report: that one was recorded, never how fast (CI's
machines are noisy; speed is measured by the benchmarks themselves)."""

from __future__ import annotations

import math


def recorded(*values: object) -> bool:
    """Each value is a recorded duration or count: a finite, non-negative number."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in values)
