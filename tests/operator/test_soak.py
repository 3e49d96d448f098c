"""The soak (``benchmarks/soak.py``): its judgement on its own, and a 5-minute run of it.

The 5-minute run is the CI version of ``make bench-soak`` (an hour): mixed traffic through a
reconciled local E+P+D deployment that switches plan every 75 s (a ratio switch and two
method switches), with every process's memory and descriptors sampled, pages read when
idle, ``/dev/shm`` and leftover processes checked at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import MIN_SAMPLES, Sample, flatness, parse_args, request_counts, soak
from benchmarks.switch_drill import Answer


def samples(pid: int, name: str, rss_kib: list[int], fds: list[int]) -> list[Sample]:
    """One sample every 10 s."""
    pairs = enumerate(zip(rss_kib, fds, strict=True))
    return [Sample(i * 10.0, pid, name, rss, fd) for i, (rss, fd) in pairs]


def test_flatness_judges_each_process_after_its_warmup() -> None:
    n = 40
    steady = samples(1, "engine e-0", [500_000] * 5 + [600_000 + (i % 3) * 1000 for i in range(n)],
                     [30] * (n + 5))  # fmt: skip
    # grows 20 % after warm-up: not flat
    growing = samples(2, "router :1", [100_000 + i * 600 for i in range(n)], [20] * n)
    # one descriptor more every sample: a leak
    leaking = samples(3, "engine p-0", [200_000] * n, [20 + i for i in range(n)])
    short = samples(4, "engine d-0", [100_000] * (MIN_SAMPLES - 1), [10] * (MIN_SAMPLES - 1))
    # one switch in a short life: more peers, more sockets, not judged
    stepped = samples(5, "engine p-1", [200_000] * 16, [20] * 8 + [30] * 8)
    everything = [*steady, *growing, *leaking, *short, *stepped]
    rows = {r["name"]: r for r in flatness(everything, 0.0, 45.0, fds_min_life_s=200.0)}
    assert rows["engine e-0"]["rss_flat"] and rows["engine e-0"]["fds_flat"]
    assert rows["engine e-0"]["rss_first_mib"] > 500  # the warm-up's lower samples left out
    assert not rows["router :1"]["rss_flat"] and rows["router :1"]["rss_growth"] > 0.1
    assert rows["engine p-0"]["rss_flat"] and not rows["engine p-0"]["fds_flat"]
    assert "rss_flat" not in rows["engine d-0"]  # too few samples to judge
    assert rows["engine p-1"]["rss_flat"] and "fds_flat" not in rows["engine p-1"]


def test_requests_that_time_out_are_hung_not_failed() -> None:
    answers = [
        Answer(0, True, 0.0, 1.0, 0.1, "ok"),
        Answer(3, False, 0.0, 2.0, None, error="InternalServerError: boom"),
        Answer(4, True, 0.0, 120.0, None, error="APITimeoutError: Request timed out."),
    ]
    counts = request_counts(answers, timeout_s=120)
    assert (counts["requests"], counts["failed"], counts["hung"]) == (3, 1, 1)
    assert counts["with_images"] == 2 and counts["streaming"] == 2


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_five_minute_soak(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = parse_args(
        ["--model", str(tiny_model_dir), "--out", str(out), "--duration-s", "300",
         "--switch-every-s", "75", "--sample-every-s", "5", "--warmup-s", "60",
         "--process-warmup-s", "45"]
    )  # fmt: skip
    summary = soak(args)
    failing = {k: v for k, v in summary["checks"].items() if not v}
    brief = {k: summary[k] for k in ("failed", "hung", "errors", "switches", "shm_entries")}
    assert not failing, (failing, brief, summary["processes"], summary["pages_when_idle"])
    assert len(summary["switches"]) == 3 and summary["requests"] > 0
    judged = [p["name"] for p in summary["processes"] if "rss_flat" in p]
    # the supervisor, the router and the encode engine live the whole run
    assert "supervisor" in judged and any(n.startswith("router") for n in judged), judged
    assert any(n.startswith("engine soak-e-") for n in judged), judged
    assert out.is_file() and (tmp_path / "raw" / "soak.json.gz").is_file()
