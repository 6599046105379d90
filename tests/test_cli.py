import subprocess
import sys


def test_bad_target_is_one_line_without_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "draftheads.cli", "info", "--target", "no such model"],
        capture_output=True, text=True,
    )
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: unknown target 'no such model'")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
