"""Every bad argument of every public function is a TypeError or ValueError
naming the argument (issue 9, item 6); DLPack capsules and any __dlpack__
object are taken by the public API (item 8); failing calls leak nothing.

The bad-argument cases (tests/bad_argument_cases.py, ~500 of them: None for
each array, K = 0, bad scales, bad cu_seqlens / state_indices contents and
types, object / str / datetime / complex / int / bool arrays, producers
whose __dlpack__ or __dlpack_device__ raises, torch tensors that require
grad at _C, num_threads = 2**40, aliasing, ...) run in child processes, a
batch per process: a case that crashes its process fails alone (its test
reports the crash), and the next process picks up after it.
"""

import gc
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import flashqla
from flashqla import _C

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bad_argument_cases  # noqa: E402

CASE_IDS = list(bad_argument_cases.CASES)
_RESULTS = {}


def _run_cases(ids):
    """Results of `ids` from child processes: id -> {"exc", "msg"} or
    {"crash": text}. A crash ends its process; the rest runs in the next."""
    todo = list(ids)
    env = dict(os.environ)  # the children import what this process imports
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in sys.path if p])
    while todo:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "bad_argument_cases.py")] + todo,
                              capture_output=True, text=True, env=env, timeout=600)
        started = None
        for line in proc.stdout.splitlines():
            d = json.loads(line)
            if d.get("start"):
                started = d["id"]
            else:
                _RESULTS[d["id"]] = d
                started = None
        done = [i for i in todo if i in _RESULTS]
        if started is None and len(done) == len(todo):
            break
        # the process died inside case `started` (or before the first one)
        culprit = started if started is not None else todo[len(done)]
        _RESULTS[culprit] = {"crash": f"exit status {proc.returncode}; stderr:\n{proc.stderr[-2000:]}"}
        todo = [i for i in todo if i not in _RESULTS]


def _result(case_id):
    if case_id not in _RESULTS:
        _run_cases([i for i in CASE_IDS if i not in _RESULTS])
    return _RESULTS[case_id]


def _names_argument(msg, argname):
    return (msg.startswith(argname + ":") or msg.startswith(argname + " and ")
            or f" and {argname} overlap" in msg)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_argument_raises_type_or_value_error_naming_it(case_id):
    argname = bad_argument_cases.CASES[case_id][0]
    r = _result(case_id)
    assert "crash" not in r, f"{case_id} crashed the interpreter: {r['crash']}"
    assert r["exc"] is not None, f"{case_id}: no exception (expected one naming {argname!r})"
    assert r["exc"] in ("TypeError", "ValueError"), f"{case_id}: {r['exc']}: {r['msg']}"
    assert _names_argument(r["msg"], argname), f"{case_id}: message does not name {argname!r}: {r['msg']}"


def test_the_runner_reports_a_crash_as_one_failed_case(tmp_path):
    """The harness itself: a case that kills its process is reported as a
    crash, the cases after it still run."""
    script = tmp_path / "cases.py"
    script.write_text(
        "import json, os, sys\n"
        "for i in sys.argv[1:]:\n"
        "    print(json.dumps({'id': i, 'start': True}), flush=True)\n"
        "    if i == 'b':\n"
        "        os.abort()\n"
        "    print(json.dumps({'id': i, 'exc': 'ValueError', 'msg': i + ': bad'}), flush=True)\n")
    results = {}
    todo = ["a", "b", "c"]
    while todo:
        p = subprocess.run([sys.executable, str(script)] + todo, capture_output=True, text=True)
        started = None
        for line in p.stdout.splitlines():
            d = json.loads(line)
            if d.get("start"):
                started = d["id"]
            else:
                results[d["id"]] = d
                started = None
        if started is not None:
            results[started] = {"crash": p.returncode}
        todo = [i for i in todo if i not in results]
    assert results["a"]["exc"] == "ValueError" and results["c"]["exc"] == "ValueError"
    assert results["b"]["crash"] != 0


# ------------------------------------------------------------- DLPack in ----

def _np_inputs(B=1, T=20, H=1, HV=2, K=16, V=16, seed=0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, H, K)).astype(np.float32)
    k = (q / np.linalg.norm(q, axis=-1, keepdims=True)).astype(np.float32)
    v = r.standard_normal((B, T, HV, V)).astype(np.float32)
    g = -np.abs(r.standard_normal((B, T, HV))).astype(np.float32)
    beta = np.full((B, T, HV), 0.5, np.float32)
    return q, k, v, g, beta


class Producer:
    """Any object with __dlpack__ / __dlpack_device__ (not a known framework)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kw):
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_public_api_takes_raw_capsules_and_dlpack_objects():
    q, k, v, g, beta = _np_inputs()
    want, _ = flashqla.gdn_chunk(q, k, v, g, beta)
    o, ht = flashqla.gdn_chunk(q.__dlpack__(), Producer(k), v.__dlpack__(max_version=(1, 0)),
                               Producer(g), beta.__dlpack__(), output_final_state=True)
    assert type(o) is np.ndarray and type(ht) is np.ndarray
    np.testing.assert_array_equal(o, want)
    # the forward/backward pair and cu_seqlens as a capsule
    cu = np.array([0, 7, 20], np.int64)
    o2, _, ctx = flashqla.gdn_chunk_fwd(Producer(q), k.__dlpack__(), v, g, beta,
                                        cu_seqlens=cu.__dlpack__())
    np.testing.assert_array_equal(o2, flashqla.gdn_chunk(q, k, v, g, beta, cu_seqlens=cu)[0])
    grads = flashqla.gdn_chunk_bwd(ctx, np.ones_like(o2).__dlpack__())
    assert all(type(x) is np.ndarray for x in grads[:5])


def test_public_recurrent_updates_a_capsule_pool_in_place():
    q, k, v, g, beta = _np_inputs(B=2, T=1)
    pool = np.zeros((3, 2, 16, 16), np.float32)
    ref_pool = pool.copy()
    ref = flashqla.gdn_recurrent(q, k, v, g, beta, ref_pool, state_indices=[2, 0])
    o = flashqla.gdn_recurrent(q.__dlpack__(), k, Producer(v), g, beta,
                               pool.__dlpack__(max_version=(1, 0)),
                               state_indices=np.array([2, 0]).__dlpack__())
    np.testing.assert_array_equal(o, ref)
    np.testing.assert_array_equal(pool, ref_pool)
    # a legacy (unversioned) capsule cannot say that its memory may be
    # written: NumPy takes it read-only, and the pool is refused, untouched
    before = pool.copy()
    with pytest.raises(ValueError, match=r"^state: is read-only"):
        flashqla.gdn_recurrent(q, k, v, g, beta, pool.__dlpack__(), state_indices=[2, 0])
    np.testing.assert_array_equal(pool, before)


def test_bfloat16_capsules_go_through_pytorch():
    torch = pytest.importorskip("torch")
    q, k, v, g, beta = (torch.from_numpy(x) for x in _np_inputs())
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    want, _ = flashqla.gdn_chunk(qb, kb, vb, g, beta)
    o, _ = flashqla.gdn_chunk(torch.utils.dlpack.to_dlpack(qb), kb.__dlpack__(), Producer(vb), g,
                              beta)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
    assert torch.equal(o, want)


def test_capsule_taken_only_once_and_used_capsule_named():
    q, k, v, g, beta = _np_inputs()
    cap = q.__dlpack__()
    flashqla.gdn_chunk(cap, k, v, g, beta)
    with pytest.raises(TypeError, match=r"^q: expected an unused DLPack capsule"):
        flashqla.gdn_chunk(cap, k, v, g, beta)


def test_dlpack_info_reads_without_taking():
    a = np.zeros((2, 3), np.float32)
    cap = a.__dlpack__()
    assert _C.dlpack_info(cap) == (1, 0, "float32")
    assert _C.dlpack_info(cap) == (1, 0, "float32")
    np.from_dlpack(type("P", (), {"__dlpack__": lambda self, **kw: cap,
                                  "__dlpack_device__": lambda self: (1, 0)})())
    with pytest.raises(TypeError):
        _C.dlpack_info(cap)      # used now
    with pytest.raises(TypeError):
        _C.dlpack_info(a)


# ---------------------------------------------------------------- memory ----

def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_ten_thousand_failing_calls_keep_memory_flat():
    """10 000 rejected calls through every kind of check (Python argument
    checks, DLPack import, binding validation, C core contents and aliasing)
    keep the resident set flat."""
    cases = [bad_argument_cases.CASES[i][1] for i in (
        "gdn_chunk-q-None", "gdn_chunk-scale-str", "gdn_chunk-q-object",
        "gdn_chunk-v-dlpack-raises", "gdn_chunk-cu_seqlens-decreasing", "gdn_chunk-g-positive",
        "gdn_recurrent-state_indices-duplicate", "gdn_recurrent-state-is-v",
        "gdn_recurrent-state_indices-bool", "_C.chunk_fwd-q-dlpack-raises-buffer",
        "_C.chunk_fwd-num_threads-huge", "_C.recurrent-state-is-o", "gdn_chunk_bwd-do-shape",
        "_C.chunk_bwd-dq-str")]

    def one(i):
        try:
            cases[i % len(cases)]()
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError("a bad call was accepted")

    for i in range(1000):
        one(i)
    gc.collect()
    start = _rss_bytes()
    for i in range(10_000):
        one(i)
    gc.collect()
    grown = _rss_bytes() - start
    assert grown < 4 << 20, f"resident memory grew by {grown / 2**20:.1f} MiB over 10 000 failing calls"
