"""The CPU backend's persistent thread pool (gdn_cpu_common.c): results do
not depend on the thread count, concurrent callers from several Python
threads get correct results, a forked child can use the pool, and a process
that used it exits normally (each in a subprocess with a timeout, so a hang
fails instead of blocking the run)."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from gdn_testing import assert_close, make_inputs, tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _decode_inputs(seed, N=8, H=2, HV=8, K=32, V=32):
    inp = make_inputs(N, 1, H, HV, K, V, seed=seed, h0=False)
    args = [inp[n].astype(np.float32) for n in ("q", "k", "v", "g", "beta")]
    pool = (np.random.default_rng(seed).standard_normal((N, HV, K, V)) * 0.5).astype(np.float32)
    return args, pool


def _decode(args, pool, threads):
    from flashqla import _C
    o = np.full_like(args[2], np.nan)
    _C.recurrent(*args, pool, o, scale=args[0].shape[-1] ** -0.5, num_threads=threads)
    return o


def test_concurrent_callers_share_the_pool():
    """Four Python threads, each decoding its own pool 10 times on 2 CPU
    threads (the binding releases the GIL): every result equals the same
    computation done alone on 1 thread."""
    work = [_decode_inputs(seed) for seed in range(4)]
    expect = []
    for args, pool in work:
        p = pool.copy()
        outs = [_decode(args, p, 1) for _ in range(10)]
        expect.append((outs, p))
    got = [None] * len(work)
    errors = []

    def run(i):
        try:
            args, pool = work[i]
            p = pool.copy()
            got[i] = ([_decode(args, p, 2) for _ in range(10)], p)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for (outs, p), (eo, ep) in zip(got, expect):
        assert np.array_equal(p, ep)
        for o, e in zip(outs, eo):
            assert np.array_equal(o, e)


SCRIPT = r"""
import os, sys
import numpy as np
sys.path.insert(0, os.path.join({root!r}, "tests"))
from test_cpu_threads import _decode_inputs, _decode
args, pool = _decode_inputs(5)
p1 = pool.copy(); o1 = _decode(args, p1, 1)
p2 = pool.copy(); o2 = _decode(args, p2, 2)   # starts the pool's worker
assert np.array_equal(o1, o2) and np.array_equal(p1, p2)
{tail}
print("ok")
"""

FORK = r"""
pid = os.fork()
if pid == 0:   # the child: the parent's worker does not exist here
    p3 = pool.copy(); o3 = _decode(args, p3, 2)
    os._exit(0 if np.array_equal(o3, o1) and np.array_equal(p3, p1) else 1)
p4 = pool.copy(); o4 = _decode(args, p4, 2)   # the parent's pool still works
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
assert np.array_equal(o4, o1) and np.array_equal(p4, p1)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_pool_after_fork():
    code = SCRIPT.format(root=ROOT, tail=FORK)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout


def test_process_exits_with_the_pool_parked():
    code = SCRIPT.format(root=ROOT, tail="")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout


def test_many_threads_on_few_items():
    """More threads than items, and a call asking for many threads: still
    every item once (the answer of 1 thread)."""
    args, pool = _decode_inputs(9, N=1, H=1, HV=2)
    p1 = pool.copy()
    o1 = _decode(args, p1, 1)
    p8 = pool.copy()
    o8 = _decode(args, p8, 8)
    assert np.array_equal(o1, o8) and np.array_equal(p1, p8)
    from flashqla import reference
    o_ref, p_ref = reference.recurrent(*(a.astype(np.float64) for a in args), pool.astype(np.float64))
    assert_close("o", o8, o_ref, tolerance("float32", "o"))
