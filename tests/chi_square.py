"""The chi-square test's critical value, shared by the distribution tests (sampler, rejection sampler)."""
from __future__ import annotations

import math

SIGNIFICANCE = 1e-3
Z_SCORE_AT_SIGNIFICANCE = 3.0902  # upper 0.1% point of the standard normal


def chi_square_critical_value(degrees_of_freedom: int) -> float:
    """Upper SIGNIFICANCE point of chi-square (Wilson-Hilferty); scipy's exact one when installed."""
    try:
        from scipy.stats import chi2
    except ImportError:
        ratio = 2.0 / (9.0 * degrees_of_freedom)
        return degrees_of_freedom * (1.0 - ratio + Z_SCORE_AT_SIGNIFICANCE * math.sqrt(ratio)) ** 3
    return float(chi2.ppf(1.0 - SIGNIFICANCE, degrees_of_freedom))
