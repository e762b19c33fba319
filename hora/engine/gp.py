"""A small Gaussian process and expected improvement, for autotune's Bayesian search (NumPy only).

Why not a library: the three candidates all cost more than they bring here. scikit-optimize is no
longer maintained (its repository was archived in 2024, and its last releases break on current NumPy);
bayesian-optimization pulls in SciPy and scikit-learn (tens of MB) for a search over two numbers;
optuna pulls in SQLAlchemy, Alembic, colorlog and tqdm, and its Gaussian-process sampler needs torch
and SciPy. hora's core dependencies are numpy, ml_dtypes, cloudpickle, psutil and PyYAML, and the
search needs about 20 points in at most 2 dimensions: an exact GP is a 20x20 Cholesky factorisation.

The model: inputs scaled to the unit cube, scores standardised (zero mean, unit variance), a
squared-exponential kernel whose length scale is the one of a short list that maximises the marginal
likelihood (a grid, not a gradient search: robust and deterministic), and ``noise`` added to the
kernel's diagonal (Horovod's ``gaussian_process_noise``: a variance relative to the standardised
scores, 0.8 by default, so single noisy samples move the model little). The next point is the
candidate of most expected improvement over the best predicted mean; candidates are a fixed grid plus
random points, from a seeded generator, so a search is reproducible.
"""

from __future__ import annotations

import math

import numpy as np

LENGTH_SCALES = (0.1, 0.15, 0.25, 0.4, 0.6, 1.0)
_SQRT2 = math.sqrt(2.0)
_erf = np.frompyfunc(math.erf, 1, 1)


def _kernel(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    return np.exp(-0.5 * d2 / (length * length))


class GaussianProcess:
    """Exact GP regression on points of the unit cube: :meth:`fit`, then :meth:`predict`."""

    def __init__(self, noise: float = 0.8, length_scales: tuple[float, ...] = LENGTH_SCALES):
        if noise <= 0:
            raise ValueError(f"noise must be > 0, got {noise}")
        self.noise = noise
        self.length_scales = length_scales
        self.length = length_scales[0]

    def fit(self, x: np.ndarray, y: np.ndarray) -> GaussianProcess:
        x = np.atleast_2d(np.asarray(x, np.float64))
        y = np.asarray(y, np.float64).ravel()
        self._mu = float(y.mean())
        self._sd = float(y.std()) or 1.0
        z = (y - self._mu) / self._sd
        best = None
        for length in self.length_scales:  # the length scale of most marginal likelihood
            k = _kernel(x, x, length) + self.noise * np.eye(len(x))
            chol = np.linalg.cholesky(k)
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, z))
            loglik = -0.5 * z @ alpha - np.log(np.diag(chol)).sum()
            if best is None or loglik > best[0]:
                best = (loglik, length, chol, alpha)
        _, self.length, self._chol, self._alpha = best
        self._x = x
        return self

    def predict(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of the latent function at ``xs``, in the scores' units."""
        xs = np.atleast_2d(np.asarray(xs, np.float64))
        ks = _kernel(xs, self._x, self.length)
        mean = ks @ self._alpha
        v = np.linalg.solve(self._chol, ks.T)
        var = np.clip(1.0 - (v * v).sum(0), 1e-12, None)
        return self._mu + self._sd * mean, self._sd * np.sqrt(var)


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float, xi: float = 0.01) -> np.ndarray:
    """E[max(f - best - xi, 0)] under N(mean, std^2), for maximisation; ``xi`` (in the units of ``std``'s
    scale, as a fraction of it) leans towards exploring."""
    std = np.maximum(std, 1e-12)
    imp = mean - best - xi * std
    z = imp / std
    cdf = 0.5 * (1.0 + _erf(z / _SQRT2).astype(np.float64))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return imp * cdf + std * pdf


def candidates(dims: int, rng: np.random.Generator, n_random: int = 512) -> np.ndarray:
    """Where the search may look next: a grid of the unit cube and random points."""
    side = 33 if dims == 1 else 17
    axes = np.meshgrid(*[np.linspace(0, 1, side)] * dims, indexing="ij")
    grid = np.stack([a.ravel() for a in axes], -1)
    return np.concatenate([grid, rng.random((n_random, dims))])


def suggest(x: np.ndarray, y: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """The next point to sample (maximising ``y``): the candidate of most expected improvement, not
    closer than 1e-3 to a point already sampled (a repeat tells the search little; autotune re-measures
    its best points separately)."""
    x = np.atleast_2d(np.asarray(x, np.float64))
    gp = GaussianProcess(noise).fit(x, y)
    cand = candidates(x.shape[1], rng)
    mean, std = gp.predict(cand)
    best = float(gp.predict(x)[0].max())
    ei = expected_improvement(mean, std, best)
    near = (np.abs(cand[:, None, :] - x[None, :, :]).max(-1) < 1e-3).any(1)
    ei[near] = -np.inf
    return cand[int(np.argmax(ei))]
