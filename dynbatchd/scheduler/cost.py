"""What a batch costs on the device, learned online: t ≈ base + per_item·n + per_token·tokens.

A channel refuses work on this estimate (admission, expiry), so a wrong one is
worse than none: one learned from a few slow first batches once answered every
request `deadline_exceeded` for good, since an expired request never runs and so
never teaches the model anything new. Hence:

- the fit forgets: each batch weighs a little less than the next one;
- it is a non-negative least squares fit (every coefficient >= 0, fitted
  jointly), so a noisy slope over a narrow range of batch sizes cannot drive
  the intercept below zero and every estimate above what was measured;
- a batch far slower or faster than the fit says (a GC pause, a warm-up, a
  neighbour on the machine) is left out of it, and three such batches in a
  row are a new regime: the fit starts again from them;
- the model says when it may be trusted to refuse work (`trusted`): only
  once settled, and only while recently confirmed by a measured batch;
- `disputed` says that the fit overestimates the recent batches by far: a
  channel then refuses nothing on it (and says so, once).
"""

from __future__ import annotations

from collections import deque

SECOND = 1_000_000_000
_NOTHING_SEEN = ((float("inf"), float("inf")), (float("-inf"), float("-inf")))


class CostModel:
    SETTLED_AFTER = 20           # batches timed before the fit is trusted to refuse work (a young fit can be far off)
    CONFIRMED_FOR_NS = 5 * SECOND   # without a measured batch for this long, it refuses nothing
    OUTLIER = 4.0                # a batch this many times slower (or faster) than the fit says is left out
    REGIME = 3                   # that many such batches in a row: the device changed, start again from them
    DISPUTE = 3.0                # the fit overestimates the last batches this many times: refuse nothing on it
    RECENT = 5                   # batches `disputed` and `measured_ns` look at

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self._sums = [0.0] * 9   # forgotten sums of w, n, k, nn, nk, kk, t, nt, kt
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=self.RECENT)   # (n, tokens, ns), as measured
        self.samples = 0
        self._coef = (0.0, 0.0, 0.0)
        self._surprises = 0          # consecutive batches far off the fit, signed by direction
        self._seen = _NOTHING_SEEN   # ((least n, tokens), (most n, tokens)) fitted: outside, no batch is an outlier
        # Read per request, so kept as plain attributes by `observe`:
        self.settled = False       # timed enough batches to be trusted to refuse work (SETTLED_AFTER)
        self.tokens_matter = True  # a request's tokens may cost device time (until a settled fit says not)
        self.confirmed_ns: int | None = None   # when the last batch was measured (None: by a caller with no clock)
        self.disputed = False      # the fit overestimates the recent batches by DISPUTE or more
        self.disputes = 0          # times `disputed` turned true (a channel logs each episode once)

    # -- learning -----------------------------------------------------------
    def observe(self, size: int, tokens: int, compute_ns: int, now_ns: int | None = None) -> None:
        n, k, t = float(size), float(tokens), float(max(1, compute_ns))
        self._recent.append((n, k, t))
        direction = 0
        lo, hi = self._seen
        if lo[0] <= n <= hi[0] and lo[1] <= k <= hi[1]:   # (beyond what it has seen, the fit only guesses)
            ratio = t / max(1.0, self.estimate_ns(size, tokens))
            direction = 1 if ratio > self.OUTLIER else -1 if ratio < 1 / self.OUTLIER else 0
        else:
            self._seen = ((min(lo[0], n), min(lo[1], k)), (max(hi[0], n), max(hi[1], k)))
        refit = not direction
        if refit:
            self._surprises = 0
            self._add(n, k, t)
        elif (self._surprises > 0) == (direction > 0) and self._surprises:
            self._surprises += direction
        else:
            self._surprises = direction
        if abs(self._surprises) >= self.REGIME:   # not an outlier: the device changed (or just warmed up)
            refit = True
            self._sums = [0.0] * 9
            self._seen = _NOTHING_SEEN
            for n, k, t in list(self._recent)[-self.REGIME:]:
                self._add(n, k, t)
                self._seen = ((min(self._seen[0][0], n), min(self._seen[0][1], k)),
                              (max(self._seen[1][0], n), max(self._seen[1][1], k)))
            self._surprises = 0
        self.samples += 1
        if now_ns is not None:
            self.confirmed_ns = now_ns
        if refit:   # (a batch left out changes no sum: the fit stands)
            self._coef = _nnls(self._sums)
        self.settled = self.samples >= self.SETTLED_AFTER
        self.tokens_matter = self._coef[2] > 0 or not self.settled
        disputed = self._overestimates_recent()
        if disputed and not self.disputed:
            self.disputes += 1
        self.disputed = disputed

    def _add(self, n: float, k: float, t: float) -> None:
        f = self.forget   # (one list a batch: this runs on the daemon's result path)
        self._sums = [a * f + v for a, v in zip(self._sums, (1.0, n, k, n * n, n * k, k * k, t, n * t, k * t))]

    def _overestimates_recent(self) -> bool:
        recent = self._recent
        if len(recent) < 3:
            return False
        # The median ratio of fit to measured is above DISPUTE when more than half of them are (no sort).
        base, per_item, per_token = self._coef
        over = sum(base + per_item * n + per_token * k > self.DISPUTE * t for n, k, t in recent)
        return over > (len(recent) - 1) // 2

    # -- reading ------------------------------------------------------------
    def coefficients(self) -> tuple[float, float, float]:
        """(base_ns, per_item_ns, per_token_ns), never negative."""
        return self._coef

    def estimate_ns(self, size: int, tokens: int = 0) -> int:
        base, per_item, per_token = self._coef
        return int(base + per_item * size + per_token * tokens)

    def trusted(self, now_ns: int) -> bool:
        """Whether a channel may refuse work on this estimate: settled, and confirmed by a measured
        batch recently (a model that refuses everything never sees a batch; it must lapse)."""
        confirmed = self.confirmed_ns
        return self.settled and (confirmed is None or now_ns - confirmed <= self.CONFIRMED_FOR_NS)

    def measured_ns(self, size: int, tokens: int = 0) -> int:
        """What the recent batches say a batch of `size` (`tokens`) takes at most: the median of
        their times, each scaled up to this batch's size and tokens where it is bigger."""
        if not self._recent:
            return 0
        bounds = sorted(t * max(1.0, size / n, tokens / k if k else 1.0) for n, k, t in self._recent)
        return int(bounds[len(bounds) // 2])


def _nnls(sums: list[float]) -> tuple[float, float, float]:
    """Weighted least squares of t on (1, n, tokens) with every coefficient >= 0, from the sums.

    With three unknowns the constrained optimum is the unconstrained optimum of one subset of
    them (the others held at 0): the full fit if it is feasible, else the feasible pair or
    single one with the least squared error (the largest c·b, as the error is Σwt² - c·b
    there). Singular equations (one batch size only; tokens proportional to size) are
    skipped; on a tie the earlier subset wins (one batch size: its mean time as base)."""
    w, n, k, nn, nk, kk, t, nt, kt = sums
    if w <= 0:
        return 0.0, 0.0, 0.0
    a = ((w, n, k), (n, nn, nk), (k, nk, kk))
    b = (t, nt, kt)
    full = _solve3(a, b)
    if full is not None and min(full) >= 0:
        return full
    best, best_score = (0.0, 0.0, 0.0), 0.0
    for i, j in ((0, 1), (0, 2), (1, 2)):
        pair = _solve2(a[i][i], a[i][j], a[j][j], b[i], b[j])
        if pair is not None and pair[0] >= 0 and pair[1] >= 0:
            score = pair[0] * b[i] + pair[1] * b[j]
            if score > best_score * (1 + 1e-9):
                coef = [0.0, 0.0, 0.0]
                coef[i], coef[j] = pair
                best, best_score = (coef[0], coef[1], coef[2]), score
    for i in range(3):
        if a[i][i] > 0:
            c = b[i] / a[i][i]
            if c * b[i] > best_score * (1 + 1e-9):
                coef = [0.0, 0.0, 0.0]
                coef[i] = c
                best, best_score = (coef[0], coef[1], coef[2]), c * b[i]
    return best


def _solve2(a11: float, a12: float, a22: float, b1: float, b2: float) -> tuple[float, float] | None:
    """The symmetric 2x2 system; None when (nearly) singular."""
    det = a11 * a22 - a12 * a12
    if det <= 1e-9 * a11 * a22:
        return None
    return (b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det


def _solve3(a: tuple[tuple[float, ...], ...], b: tuple[float, ...]) -> tuple[float, float, float] | None:
    """The symmetric 3x3 system by Cramer's rule; None when (nearly) singular."""
    (a11, a12, a13), (_, a22, a23), (_, _, a33) = a
    m11, m12, m13 = a22 * a33 - a23 * a23, a13 * a23 - a12 * a33, a12 * a23 - a13 * a22   # cofactors
    det = a11 * m11 + a12 * m12 + a13 * m13
    if det <= 1e-9 * a11 * a22 * a33:
        return None
    m22, m23, m33 = a11 * a33 - a13 * a13, a12 * a13 - a11 * a23, a11 * a22 - a12 * a12
    b1, b2, b3 = b
    return ((m11 * b1 + m12 * b2 + m13 * b3) / det, (m12 * b1 + m22 * b2 + m23 * b3) / det,
            (m13 * b1 + m23 * b2 + m33 * b3) / det)
