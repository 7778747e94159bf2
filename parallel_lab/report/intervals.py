"""Medians with 95% intervals, and the one rule for calling one time faster than another.

The interval is the distribution-free order-statistic interval of the median: for n samples sorted
x(1) <= ... <= x(n), the number below the true median is Binomial(n, 1/2), so [x(k), x(n+1-k)]
holds it with probability 1 - 2 P(B <= k-1) whatever the distribution (continuous, independent
draws). ``median_ci`` takes the narrowest such interval at >= 95%; fewer than 6 samples cannot
reach 95% (n = 5: the whole range holds the median 94%), so there it gives the range and says
its own level (1 - 2^(1-n)). The same interval transforms with any monotone map: samples/s is
global_batch / step time, its interval the step time's, inverted. docs/results.md says why this
method and what its samples are (rounds, or steps of one run).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LEVEL = 0.95  # the confidence every interval of the report aims at
SAME = "same within noise"


def _binomial_cdf(k: int, n: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def order_ranks(n: int, level: float = LEVEL) -> tuple[int, float]:
    """(k, coverage): the largest k (1-based) whose [x(k), x(n+1-k)] covers the median with
    probability >= level, and that probability; k = 1 (the range) with its lower coverage when no
    k reaches level."""
    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * _binomial_cdf(k, n) >= level:
        k += 1
    return k, 1 - 2 * _binomial_cdf(k - 1, n)


@dataclass(frozen=True)
class Interval:
    """A median and its interval: ``level`` is the interval's own coverage (>= LEVEL from 6
    samples on; 0 for a single sample, which has no interval), ``n`` the samples, ``over`` what
    they were ("rounds" or "steps")."""

    median: float
    low: float
    high: float
    n: int
    level: float
    over: str = ""

    def map(self, fn) -> Interval:
        """The interval of fn(x) for a monotone fn (decreasing ones swap the ends)."""
        a, b = fn(self.low), fn(self.high)
        return Interval(fn(self.median), min(a, b), max(a, b), self.n, self.level, self.over)

    def as_list(self) -> list[float]:
        return [self.low, self.high]


def median_ci(samples: list[float], over: str = "", level: float = LEVEL) -> Interval | None:
    """The median of the samples and its order-statistic interval (None without samples)."""
    if not samples:
        return None
    xs = sorted(samples)
    n = len(xs)
    if n == 1:
        return Interval(xs[0], xs[0], xs[0], 1, 0.0, over)
    k, coverage = order_ranks(n, level)
    return Interval(statistics.median(xs), xs[k - 1], xs[n - k], n, coverage, over)


def verdict(time: Interval | None, base: Interval | None) -> str:
    """'faster' / 'slower' (with the ratio of the medians) where the two time intervals do not
    overlap, SAME where they do; blank where either has no interval (one sample)."""
    if time is None or base is None or time.n < 2 or base.n < 2:
        return ""
    if time.high < base.low:
        return f"{base.median / time.median:.2f}× faster"
    if time.low > base.high:
        return f"{time.median / base.median:.2f}× slower"
    return SAME


def rotation(items: list, round_index: int) -> list:
    """Round r's order: every item once, starting at item r mod n (a drift in the machine's load
    during a sweep then falls on every strategy alike)."""
    if not items:
        return []
    start = round_index % len(items)
    return items[start:] + items[:start]
