"""What the Python test scripts share (tests/ops/*.py, tests/python/*.py; each puts tests/support on
sys.path): running a list of test functions, reporting every one, and checking an error's message."""
import time
import traceback


def expect_error(fn, needle, exc=RuntimeError):
    """fn() must raise `exc` with `needle` in its message."""
    try:
        fn()
    except exc as e:
        assert needle in str(e), f"{exc.__name__} does not mention {needle!r}: {e}"
        return
    raise AssertionError(f"no {exc.__name__} (expected one mentioning {needle!r})")


def run_tests(tests):
    """Runs every test function of `tests` (a failure does not stop the others), printing
    "PASS name (seconds)" or "FAIL name" with the traceback; returns the number that failed."""
    failed = 0
    for test in tests:
        t = time.perf_counter()
        try:
            test()
            print(f"PASS {test.__name__} ({time.perf_counter() - t:.1f} s)", flush=True)
        except Exception:  # report every test, then fail
            failed += 1
            print(f"FAIL {test.__name__}\n{traceback.format_exc()}", flush=True)
    return failed
