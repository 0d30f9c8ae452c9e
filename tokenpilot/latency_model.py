"""A latency model learned from observations, on top of the roofline prior: TTFT and TPOT per (request, instance).

The cost model predicts a request's TTFT (queue + prefill) and time per output token
from physics (`tokenpilot.priors`) with a few bounded online factors. What physics
leaves out (engine scheduling, how chunks share a step, the duty estimate's bias under
load) shows up as a residual: observed minus prior prediction. This module fits that
residual, log(observed / prior), as a linear function of features of the (request, instance) pair at the
moment of the decision, with scikit-learn's ridge regression, so that:

* thin data means the prior: until `min_samples` outcomes are in, the ridge penalty
  keeps every coefficient near zero, and a fit that does not beat the prior on the newest
  outcomes (held out) is not installed: the prediction stays the prior's;
* the fit runs off the decision path, when the caller asks (`refit`): the gateway from
  a background task, the simulator every `refit_every` outcomes in virtual time; both
  call the same `refit`, which fits on a copy of the buffer and installs the result in
  one assignment;
* the decision applies it with one small matrix product (numpy), never scikit-learn;
* the correction is bounded (`max_ratio` of the prior either way), so a bad fit cannot
  make a decision absurd, and the buffer is bounded (`capacity` most recent outcomes).

Features (`FEATURES`): the cost model's queue and prefill seconds, uncached prompt
tokens, decode streams and their context there, KV usage, engine-reported waiting
requests, the prefill batch budget, and the scheduler-forward prior's own terms (its
TTFT, its log and its inverse: a fixed cost outside the engine, such as the relay's, is
log(1 + c / TTFT) in the residual; the prefill tokens ahead, the streams decoding). Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

try:  # the ufunc `np.clip` ends in (numpy 2: `numpy._core`), called without `np.clip`'s Python wrapper
    from numpy._core.umath import clip as _clip
except ImportError:  # numpy 1.x
    from numpy.core.umath import clip as _clip

FEATURES = ("queue_s", "prefill_s", "uncached_ktok", "streams", "context_mtok", "kv_usage", "waiting",
            "budget_ktok", "forward_s", "ahead_ktok", "decoding", "log_forward", "inv_forward")
N_FEATURES = len(FEATURES)
MIN_GAIN = 0.95  # a fit is installed only if it cuts the prior's held-out error by 5% or more


@dataclass(frozen=True, slots=True)
class Fit:
    """One target's residual model, log(observed / prior) = (x - mean) / scale @ coef + intercept."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    samples: int
    # mean and scale as columns, made once (a decision applies the fit to a features x candidates matrix)
    _mean_col: np.ndarray = field(init=False, repr=False, compare=False)
    _scale_col: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_mean_col", self.mean[:, None])
        object.__setattr__(self, "_scale_col", self.scale[:, None])

    def residual(self, x: np.ndarray) -> np.ndarray:
        """x: (features, candidates) -> log residual per candidate."""
        return ((x - self._mean_col) / self._scale_col).T @ self.coef + self.intercept


class LearnedLatency:
    """Residual models of TTFT and TPOT over the prior, fitted on request outcomes."""

    def __init__(self, capacity: int = 4096, min_samples: int = 256, refit_every: int = 512,
                 alpha: float = 1.0, max_ratio: float = 4.0) -> None:
        self.capacity, self.min_samples, self.refit_every = capacity, min_samples, refit_every
        self.alpha, self.max_ratio = alpha, max_ratio
        self._bound = (max_ratio, float(np.log(max_ratio)))  # (max_ratio, its log): see `_log_bound`
        self._x = np.zeros((capacity, N_FEATURES))
        self._y = np.full((capacity, 2), np.nan)  # log(observed / prior): TTFT, TPOT (NaN: not observed)
        self._n = 0  # outcomes recorded in all (the ring's write position is n % capacity)
        self._since_fit = 0
        self.ttft: Fit | None = None
        self.tpot: Fit | None = None

    # -- data --------------------------------------------------------------------
    def record(self, features: np.ndarray, prior_ttft_s: float, prior_tpot_s: float,
               observed_ttft_s: float | None, observed_tpot_s: float | None) -> None:
        """One outcome: the features and prior predictions at its decision, and what it got."""
        i = self._n % self.capacity
        self._x[i] = features
        self._y[i, 0] = self._log_ratio(observed_ttft_s, prior_ttft_s)
        self._y[i, 1] = self._log_ratio(observed_tpot_s, prior_tpot_s)
        self._n += 1
        self._since_fit += 1

    def _log_bound(self) -> float:
        """log(max_ratio), computed once per value of `max_ratio` (numpy's log, as it always was)."""
        ratio, bound = self._bound
        if ratio != self.max_ratio:
            self._bound = ratio, bound = self.max_ratio, float(np.log(self.max_ratio))
        return bound

    def _log_ratio(self, observed: float | None, prior: float) -> float:
        if observed is None or not observed > 0 or not prior > 0:
            return float("nan")
        bound = self._log_bound()  # one wild outcome is a bounded sample, like the fit
        # np.clip of one float, in plain Python (NaN stays NaN, as np.clip keeps it)
        v = float(np.log(observed / prior))
        return v if v != v else min(max(v, -bound), bound)

    @property
    def samples(self) -> int:
        return min(self._n, self.capacity)

    def refit_due(self) -> bool:
        return self._since_fit >= self.refit_every and self.samples >= self.min_samples

    # -- fitting (off the decision path) -------------------------------------------
    def training_data(self) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the buffer (what a background fit works on while decisions go on)."""
        n = self.samples
        return self._x[:n].copy(), self._y[:n].copy()

    def prepare(self) -> None:
        """Import the fitter's library now (`refit` would on its first call). scikit-learn's import
        takes ~0.9 s of CPU with the GIL held most of it: left to the first refit, a worker thread
        mid-serving, it stalls the event loop that long (bench/README.md, "First refit")."""
        from sklearn.linear_model import Ridge  # noqa: F401

    def refit(self) -> bool:
        """Fit both residual models on the buffer and install them; False when data is thin."""
        x, y = self.training_data()
        self._since_fit = 0
        fits = fit_residuals(x, y, self.min_samples, self.alpha)
        if fits is None:
            return False
        self.ttft, self.tpot = fits  # one assignment each: a decision sees the old or the new fit
        return True

    # -- prediction (numpy only) ----------------------------------------------------
    def correct(self, fit: Fit | None, prior: np.ndarray, x: np.ndarray) -> np.ndarray:
        """prior x exp(learned log residual), within max_ratio of the prior either way; the prior if unfitted."""
        if fit is None:
            return prior
        return corrected(fit, prior, x, self._log_bound())

    def log_bound(self) -> float:
        """log(max_ratio): the bound `correct` holds the learned residual within, now."""
        return self._log_bound()


def corrected(fit: Fit, prior: np.ndarray, x: np.ndarray, bound: float) -> np.ndarray:
    """`LearnedLatency.correct` with a fit and its bound given (`bound`: `log_bound()` when it was
    asked): what a caller that defers the correction computes later, the same floats."""
    return prior * np.exp(_clip(fit.residual(x), -bound, bound))


def fit_residuals(x: np.ndarray, y: np.ndarray, min_samples: int, alpha: float,
                  holdout: float = 0.2) -> tuple[Fit | None, Fit | None] | None:
    """Ridge fits of the TTFT and TPOT log residuals, in order of arrival: fitted on the older
    (1 - holdout) and kept only if they beat the prior on the newest outcomes by `MIN_GAIN` (mean
    absolute log error); None for a target with too few observations or whose fit does not help."""
    from sklearn.linear_model import Ridge  # imported here: only a fit needs it, never a decision

    out: list[Fit | None] = []
    for j in range(2):
        ok = np.isfinite(y[:, j])
        if ok.sum() < min_samples:
            out.append(None)
            continue
        xs, ys = x[ok], y[ok, j]
        cut = int(len(ys) * (1 - holdout))
        mean = xs[:cut].mean(axis=0)
        scale = xs[:cut].std(axis=0)
        scale[scale < 1e-12] = 1.0
        model = Ridge(alpha=alpha).fit((xs[:cut] - mean) / scale, ys[:cut])
        fit = Fit(mean, scale, np.asarray(model.coef_, dtype=float), float(model.intercept_), cut)
        test_x, test_y = xs[cut:], ys[cut:]
        learned = np.abs(test_y - fit.residual(test_x.T)).mean()
        out.append(fit if learned < MIN_GAIN * np.abs(test_y).mean() else None)
    if out[0] is None and out[1] is None:
        return None
    return out[0], out[1]
