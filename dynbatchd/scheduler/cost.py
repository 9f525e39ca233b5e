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
    FAR = 16   # a settled fit's batch of this many times the most tokens it has seen, far faster than
    # the fit says, is an outlier too (REGIME of them in a row: a new regime): one request whose client
    # claimed a billion tokens for a 10 ms batch otherwise set the per-token cost to 0 for 200 batches

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
        recent = self._recent
        recent.append((n, k, t))
        direction = 0
        lo, hi = self._seen
        if lo[0] <= n <= hi[0] and lo[1] <= k <= hi[1]:   # (beyond what it has seen, the fit only guesses)
            ratio = t / max(1.0, self.estimate_ns(size, tokens))
            direction = 1 if ratio > self.OUTLIER else -1 if ratio < 1 / self.OUTLIER else 0
        elif self.settled and k > self.FAR * hi[1] and t * self.OUTLIER < self.estimate_ns(size, tokens):
            direction = -1   # far past every batch seen, and far faster than that size says: see FAR
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
        if self._surprises and abs(self._surprises) >= self.REGIME:   # not an outlier: the device changed (or just warmed up)
            refit = True
            self._sums = [0.0] * 9
            self._seen = _NOTHING_SEEN
            for n, k, t in list(recent)[-self.REGIME:]:
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
        f = self.forget   # (written out, not zipped: this runs once a batch on the daemon's result path)
        w, sn, sk, nn, nk, kk, st, nt, kt = self._sums
        self._sums = [w * f + 1.0, sn * f + n, sk * f + k, nn * f + n * n, nk * f + n * k, kk * f + k * k,
                      st * f + t, nt * f + n * t, kt * f + k * t]

    def _overestimates_recent(self) -> bool:
        """Whether the fit overestimates most recent batches: the median ratio of fit to measured is
        above DISPUTE when more than half of them are (counted, no sort)."""
        recent = self._recent
        if len(recent) < 3:
            return False
        base, per_item, per_token = self._coef
        over, limit = 0, self.DISPUTE
        for n, k, t in recent:
            if base + per_item * n + per_token * k > limit * t:
                over += 1
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
    skipped; on a tie the earlier subset wins (one batch size: its mean time as base).
    The 3x3 (Cramer's rule) and 2x2 solves are written out: this runs once a batch."""
    w, n, k, nn, nk, kk, t, nt, kt = sums
    if w <= 0:
        return 0.0, 0.0, 0.0
    m11, m12, m13 = nn * kk - nk * nk, k * nk - n * kk, n * nk - k * nn   # cofactors of the normal equations
    det = w * m11 + n * m12 + k * m13
    if det > 1e-9 * w * nn * kk:   # (else (nearly) singular)
        m22, m23, m33 = w * kk - k * k, n * k - w * nk, w * nn - n * n
        full = ((m11 * t + m12 * nt + m13 * kt) / det, (m12 * t + m22 * nt + m23 * kt) / det,
                (m13 * t + m23 * nt + m33 * kt) / det)
        if min(full) >= 0:
            return full
    # The pairs (base, per item), (base, per token), (per item, per token), then each single one; a later
    # subset replaces an earlier one only if its score is higher (by 1e-9, so a tie keeps the earlier).
    best, best_score = (0.0, 0.0, 0.0), 0.0
    det = w * nn - n * n
    if det > 1e-9 * w * nn:
        c1, c2 = (t * nn - n * nt) / det, (w * nt - n * t) / det
        if c1 >= 0 and c2 >= 0 and (score := c1 * t + c2 * nt) > 0.0:
            best, best_score = (c1, c2, 0.0), score
    det = w * kk - k * k
    if det > 1e-9 * w * kk:
        c1, c2 = (t * kk - k * kt) / det, (w * kt - k * t) / det
        if c1 >= 0 and c2 >= 0 and (score := c1 * t + c2 * kt) > best_score * (1 + 1e-9):
            best, best_score = (c1, 0.0, c2), score
    det = nn * kk - nk * nk
    if det > 1e-9 * nn * kk:
        c1, c2 = (nt * kk - nk * kt) / det, (nn * kt - nk * nt) / det
        if c1 >= 0 and c2 >= 0 and (score := c1 * nt + c2 * kt) > best_score * (1 + 1e-9):
            best, best_score = (0.0, c1, c2), score
    if (c := t / w) * t > best_score * (1 + 1e-9):   # (w > 0 here)
        best, best_score = (c, 0.0, 0.0), c * t
    if nn > 0 and (c := nt / nn) * nt > best_score * (1 + 1e-9):
        best, best_score = (0.0, c, 0.0), c * nt
    if kk > 0 and (c := kt / kk) * kt > best_score * (1 + 1e-9):
        best = (0.0, 0.0, c)
    return best
