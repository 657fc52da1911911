"""The runner: every check answers, a hanging one is abandoned in time, a raising one becomes a failure."""

from __future__ import annotations

import threading
import time

from pdkv.doctor import CheckResult, DoctorOptions, Host, Status, SysRoot, run_checks, run_doctor


def bare_host() -> Host:
    def unused():
        raise AssertionError("not used")

    return Host(root=SysRoot("/nonexistent"), env={}, gpus=unused, net_addrs=unused, dmabuf=unused)


def check_quick(host, options):
    return CheckResult("quick", Status.PASS, "fine")


def check_raises(host, options):
    raise RuntimeError("sysfs exploded")


release = threading.Event()


def check_hangs(host, options):
    release.wait(30)  # stands for a driver call that never returns
    return CheckResult("hangs", Status.PASS, "late")


def test_hang_is_abandoned_and_raise_becomes_failure():
    options = DoctorOptions(check_timeout_s=0.3)
    seen: list[str] = []
    start = time.monotonic()
    try:
        results = run_checks(options, bare_host(), [check_quick, check_raises, check_hangs], on_result=lambda r: seen.append(r.name))
    finally:
        release.set()
    elapsed = time.monotonic() - start
    assert elapsed < 2.0
    assert [r.name for r in results] == ["quick", "raises", "hangs"]
    assert results[0].status is Status.PASS
    assert results[1].status is Status.FAIL and "RuntimeError: sysfs exploded" in results[1].detail
    assert results[2].status is Status.FAIL and "no answer within 0.3 s" in results[2].detail and results[2].hint
    assert sorted(seen) == ["hangs", "quick", "raises"]


def test_report_counts_and_ok():
    report = run_doctor(DoctorOptions(), host=bare_host(), checks=[check_quick, check_raises])
    assert not report.ok
    assert report.counts == {"pass": 1, "warn": 0, "fail": 1, "skip": 0}
    assert [c.name for c in report.checks] == ["raises", "quick"]
    assert report.sys_root == "/nonexistent"
