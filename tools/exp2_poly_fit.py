"""Fit the CPU kernels' exp2 polynomial (``numba_flash.cpu.simd.EXP2_P1`` .. ``EXP2_P6``) and measure it in float32.

    python tools/exp2_poly_fit.py --degree 6

2^f on |f| <= 1/2 by a polynomial of the given degree minimising the largest relative error: weighted least squares
on Chebyshev points, reweighted by Lawson's iteration towards the minimax fit, in float64. The coefficients are then
rounded to float32 and evaluated as the kernels do (Horner's rule, one rounding per fused multiply-add) on a
2-million-point grid; the largest and mean error in float32 ulps are printed, and Taylor's series of exp(f ln 2) of
the same degree for comparison.
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def fit(degree: int, points: int = 4001, rounds: int = 200) -> np.ndarray:
    """Coefficients c[0..degree] (float64, lowest first) of the near-minimax relative-error fit of 2^f."""
    x = np.cos(np.linspace(0, np.pi, points)) * 0.5
    weight = 2.0 ** -x   # relative error
    lawson = np.ones_like(x)
    for _ in range(rounds):
        w = weight * np.sqrt(lawson)
        coef, *_ = np.linalg.lstsq(np.vander(x, degree + 1, increasing=True) * w[:, None], 2.0 ** x * w, rcond=None)
        err = np.abs(np.polyval(coef[::-1], x) * weight - 1)
        lawson = lawson * err
        lawson /= lawson.sum()
    return coef


def float32_ulps(coef: np.ndarray) -> tuple[float, float]:
    """Largest and mean error in ulps of the float32 Horner evaluation of ``coef`` (rounded to float32)."""
    c32 = coef.astype(np.float32)
    f = np.linspace(-0.5, 0.5, 2_000_001).astype(np.float32)
    p = np.full_like(f, c32[-1])
    for c in c32[-2::-1]:
        p = (p.astype(np.float64) * f + c).astype(np.float32)   # a fused multiply-add: one rounding
    exact = 2.0 ** f.astype(np.float64)
    ulps = np.abs(p - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    return float(ulps.max()), float(ulps.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=6)
    args = ap.parse_args()
    coef = fit(args.degree)
    print("float32 coefficients, lowest first:", [float(c) for c in coef.astype(np.float32)])
    print("fit: max ulp %.3f, mean %.3f" % float32_ulps(coef))
    taylor = np.array([math.log(2) ** k / math.factorial(k) for k in range(args.degree + 1)])
    print("Taylor, same degree: max ulp %.3f, mean %.3f" % float32_ulps(taylor))


if __name__ == "__main__":
    main()
