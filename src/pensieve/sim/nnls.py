"""Non-negative least squares for :meth:`pensieve.sim.step_cost.StepCostModel.fit`:
scipy's solver when installed, else an active-set NNLS on numpy."""

from __future__ import annotations

from typing import Any


def nnls_scaled(a: Any, b: Any) -> Any:
    """NNLS on column-normalised ``a`` (features span ~1 to ~1e9), all-zero columns -> 0."""
    import numpy as np

    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    x = np.zeros(a.shape[1])
    if live.any():
        x[live] = nnls(a[:, live] / norms[live], b) / norms[live]
    return x


def nnls(a: Any, b: Any, max_iter: int | None = None) -> Any:
    """``argmin ||a x - b||_2`` subject to ``x >= 0``: scipy's solver when installed, else
    Lawson-Hanson active set on numpy."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    try:
        from scipy.optimize import nnls as scipy_nnls
    except ImportError:
        return _nnls_active_set(a, b, max_iter)
    return scipy_nnls(a, b)[0]


def _nnls_active_set(a: Any, b: Any, max_iter: int | None = None) -> Any:
    """Lawson & Hanson (1974), Algorithm NNLS."""
    import numpy as np

    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(np.float64).eps * np.linalg.norm(a, 1) * max(m, n)
    max_iter = 3 * n if max_iter is None else max_iter
    w = a.T @ (b - a @ x)
    it = 0
    while (~passive).any() and (w[~passive] > tol).any():
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            it += 1
            if it > max_iter * 10:
                return x
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            denom = x[bad] - z[bad]
            ratio = np.divide(x[bad], denom, out=np.zeros_like(denom), where=denom > 0)
            alpha = float(np.min(ratio))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x
