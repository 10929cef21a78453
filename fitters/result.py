"""Fit results shared by every online fitter (MODEL.md §6).

Each fit reports value, standard error, samples used, R² and a status. A value whose status is
not ``ok`` is never published as if it were good (MODEL.md §6): the collector shows only the
status and the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class Status(str, Enum):
    """Why a fit can or cannot be trusted (MODEL.md §6)."""

    OK = "ok"
    INSUFFICIENT_DATA = "insufficient_data"
    INSUFFICIENT_VARIATION = "insufficient_variation"
    NOT_IDENTIFIABLE = "not_identifiable"


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
Z95 = 1.959963984540054  # two-sided 95 % normal quantile
# What follows this in a reason are the values measured this scrape: the JSON API shows the whole
# reason, a Prometheus label (kvhit_unknown_info, kvhit_warning_info) the part before it
# (:func:`label_reason`), so the series stays one while the values move.
MEASURED = " (measured: "


def label_reason(reason: str) -> str:
    """``reason`` without its measured values (:data:`MEASURED` to the end)."""
    return reason.split(MEASURED, 1)[0]


def measured(text: str) -> str:
    """``text`` as the measured values that end a reason."""
    return f"{MEASURED}{text})"


@dataclass(frozen=True)
class Estimate:
    """One fitted parameter: value and 1-sigma standard error (same unit as the value).

    ``status`` is per parameter: a fit can be ``ok`` overall while one term is
    ``not_identifiable`` (e.g. k_dec vs k_ctx when ISL and OSL never vary, MODEL.md §6).
    """

    value: float
    stderr: float = math.nan
    status: Status = Status.OK
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK and math.isfinite(self.value)


@dataclass(frozen=True)
class FitResult:
    """Outcome of one fitter at one moment.

    Attributes:
        status: overall status of the fit.
        reason: one human sentence explaining a status other than ok ("" when ok).
        params: fitted parameters by name (units in the fitter's docstring).
        samples: observations used by the last fit (after anomaly rejection).
        r2: coefficient of determination of the last fit (nan when not fitted).
        covariance: covariance matrix of the parameters in ``params`` order (None when unknown);
            used to propagate errors to derived quantities (e.g. R'(h) interval, MODEL.md §4).
        extra: fitter-specific diagnostics (e.g. anomaly count): JSON-serialisable numbers, strings,
            lists and mappings of them.
    """

    status: Status
    reason: str = ""
    params: dict[str, Estimate] = field(default_factory=dict)
    samples: int = 0
    r2: float = math.nan
    covariance: tuple[tuple[float, ...], ...] | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def value(self, name: str) -> float | None:
        """The value of parameter ``name`` if the fit and that parameter are ok, else None."""
        est = self.params.get(name)
        if not self.ok or est is None or not est.ok:
            return None
        return est.value

    @classmethod
    def failed(cls, status: Status, reason: str, samples: int = 0) -> "FitResult":
        return cls(status=status, reason=reason, samples=samples)
