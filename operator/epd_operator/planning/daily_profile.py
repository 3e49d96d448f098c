"""The daily profile: yesterday's rate curve, scaled to today's level, under the forecast.

The trend (``forecast.py``) reads only the trace window, so it sees a daily ramp once the
ramp has begun. Where Prometheus holds a day of ``epd_requests_total``, the loop also asks
how the rate moved a day ago over the same stretch: from the window ending now to the
window ending ``horizon`` later. That ratio times today's window rate is the profile's
forecast, a floor under the trend's: a morning ramp is planned for before it shows in the
window. It only raises the target: a profile that promises a drop does not shrink the pools
before the window shows it (a holiday is not a Monday), and it is capped as the trend is
(``GROWTH_CAP``). Seasonal naive, level-adjusted: no fit, no state beyond what Prometheus
keeps (its retention is 15 days by default), and nothing without the history.
"""

from __future__ import annotations

from epd_operator.planning.prometheus import Prometheus

DAY_S = 86_400


def profile_ratio(
    prom: Prometheus,
    model: str,
    namespace: str,
    window_s: int,
    horizon_s: float,
    period_s: int = DAY_S,
) -> float | None:
    """A period ago: requests in the window that ended ``horizon_s`` later over those in the
    window that ended then. None without that history (or an idle window a period ago)."""
    ahead = round(period_s - horizon_s)
    if ahead <= 0 or window_s <= 0:
        return None
    then = prom.requests(model, namespace, window_s, period_s)
    later = prom.requests(model, namespace, window_s, ahead)
    if then is None or later is None or then <= 0:
        return None
    return later / then
