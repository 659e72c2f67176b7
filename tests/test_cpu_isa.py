"""The CPU backend's kernel sets (csrc/cpu/gdn_cpu_kernels_<isa>.c): avx512,
avx2, neon, scalar. The set is chosen once per process (cpuid on x86-64, the
build on AArch64) or forced with FLASHQLA_CPU_ISA, so every check of a
forced set runs in a subprocess: the CPU numerical test files run again
under each set this machine can execute (the default set is the one the
main test run uses), plus the kernel-set-specific shapes of
test_cpu_kernels.py. NEON is checked on x86 machines by CI under qemu-user
(.ci/run: make -C dev arm)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETS = ["avx512", "avx2", "neon", "scalar"]
NUMERICAL_FILES = ["test_chunk_fwd.py", "test_recurrent.py", "test_chunk_bwd.py",
                   "test_numerics_isolation.py", "test_serving.py", "test_cpu_kernels.py"]


def _env(isa):
    env = dict(os.environ)
    if isa is None:
        env.pop("FLASHQLA_CPU_ISA", None)
    else:
        env["FLASHQLA_CPU_ISA"] = isa
    return env


def _probe(isa):
    """(returncode, stdout + stderr) of `flashqla._C.cpu_isa()` under the set."""
    code = ("import sys\nfrom flashqla import _C\n"
            "try:\n    print(_C.cpu_isa())\n"
            "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e)); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(isa), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    return r.returncode, r.stdout.strip()


def _default_set():
    rc, out = _probe(None)
    assert rc == 0, out
    return out.splitlines()[-1]


def test_default_set_is_the_best_this_cpu_runs():
    default = _default_set()
    assert default in SETS
    from flashqla import _C
    if "FLASHQLA_CPU_ISA" not in os.environ:
        assert _C.cpu_isa() == default
    # every set better than the default is refused on this machine
    for isa in SETS[:SETS.index(default)]:
        rc, out = _probe(isa)
        assert rc == 3 and "Error" in out and "FLASHQLA_CPU_ISA=" + isa in out, out


@pytest.mark.parametrize("isa", SETS)
def test_forced_set_passes_the_cpu_tests(isa):
    rc, out = _probe(isa)
    if rc != 0:
        # refused with a message that names what this CPU / build can run
        assert "this CPU and build can run" in out, out
        pytest.skip(f"{isa} cannot run here ({out}); CI checks NEON under qemu-user: make -C dev arm")
    assert out.splitlines()[-1] == isa, f"FLASHQLA_CPU_ISA={isa} ran {out!r}"
    if isa == _default_set() and "FLASHQLA_CPU_ISA" not in os.environ:
        pytest.skip(f"{isa} is this machine's default set: the main test run covers it")
    files = [os.path.join(HERE, f) for f in NUMERICAL_FILES]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                       env=_env(isa), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=1800)
    assert r.returncode == 0, f"FLASHQLA_CPU_ISA={isa}:\n{r.stdout[-6000:]}"
    assert " passed" in r.stdout


def test_unknown_set_is_a_value_error():
    rc, out = _probe("sse9")
    assert rc == 3 and out.startswith("ValueError") and "FLASHQLA_CPU_ISA=sse9" in out, out
    assert "expected auto, avx512, avx2, neon or scalar" in out


def test_refused_set_fails_every_cpu_call_cleanly():
    """A forced set this machine cannot run: every CPU entry point raises
    (flashqla.Error), nothing crashes and the outputs stay untouched."""
    default = _default_set()
    cannot = [s for s in SETS if _probe(s)[0] != 0]
    if not cannot:
        pytest.skip("this machine runs every kernel set")
    code = r"""
import numpy as np, flashqla
from flashqla import _C
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
v = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
g = -np.ones((1, 8, 1), np.float32); b = np.full((1, 8, 1), 0.5, np.float32)
o = np.full_like(v, 7.0)
try:
    _C.chunk_fwd(q, q, v, g, b, o, scale=0.25)
    raise SystemExit("chunk_fwd ran")
except flashqla.Error as e:
    assert "FLASHQLA_CPU_ISA" in str(e), e
assert (o == 7.0).all(), "a refused call wrote its output"
pool = np.zeros((1, 1, 16, 16), np.float32)
try:
    flashqla.gdn_recurrent(q[:, :1], q[:, :1], v[:, :1], g[:, :1], b[:, :1], pool)
    raise SystemExit("recurrent ran")
except flashqla.Error as e:
    assert "FLASHQLA_CPU_ISA" in str(e), e
print("refused")
"""
    r = subprocess.run([sys.executable, "-c", code], env=_env(cannot[0]), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("refused"), (cannot[0], default, r.stdout)
