"""python -m flashqla.demo: runs, checks itself against the reference and
reports throughput (a small CPU size here; the default size is the README's
main job)."""

import subprocess
import sys

from flashqla import demo


def test_demo_small_cpu_run(capsys):
    rc = demo.main(["--device", "cpu", "--tokens", "300", "--heads", "1/2", "--dim", "32",
                    "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "result: PASS" in out and "M tokens/s" in out
    assert "forward + backward" in out


def test_demo_runs_as_module():
    out = subprocess.run([sys.executable, "-m", "flashqla.demo", "--device", "cpu", "--tokens",
                          "100", "--heads", "2/4", "--dim", "16", "--repeats", "1",
                          "--no-backward"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "result: PASS" in out.stdout
