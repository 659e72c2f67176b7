"""Bad and unusual arguments on the CPU backend (issue 9, items 4, 5, 7):

- state_indices: a non-negative slot used twice raises ValueError naming
  state_indices (two sequences would update one pool slot at the same time);
  negative slots (padding) may repeat; nothing is written on a rejected call.
- aliasing: a buffer the call writes (o, the state pool, final_state, the
  gradients) that shares memory with any other argument raises ValueError
  naming both; inputs may alias each other.
- g: a positive or NaN gate raises ValueError naming g, with the hint that g
  is the log-space decay (g <= 0); -inf is legal (a full reset).

Item 6 (every bad argument of every public function) and the memory checks
are in test_bad_arguments.py.
"""

import numpy as np
import pytest

import flashqla
from flashqla import _C

B, T, H, HV, K, V = 2, 20, 1, 2, 16, 16


def _inputs(B=B, T=T, seed=0, dtype=np.float32):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, H, K)).astype(dtype)
    k = (q / np.linalg.norm(q, axis=-1, keepdims=True)).astype(dtype)
    v = r.standard_normal((B, T, HV, V)).astype(dtype)
    g = -np.abs(r.standard_normal((B, T, HV))).astype(np.float32)
    beta = np.full((B, T, HV), 0.5, np.float32)
    return q, k, v, g, beta


def _nan(shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype)


# ---------------------------------------------------------- state_indices ----

@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_duplicate_state_indices_raise_and_write_nothing(idx_dtype):
    q, k, v, g, beta = _inputs(B=3, T=1)
    pool = np.zeros((4, HV, K, V), np.float32)
    before = pool.copy()
    idx = np.array([2, 0, 2], idx_dtype)
    with pytest.raises(ValueError, match=r"^state_indices: slot 2 appears twice \(entries 0 and 2\)"):
        flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=idx)
    np.testing.assert_array_equal(pool, before)
    o = _nan((3, 1, HV, V))
    with pytest.raises(ValueError, match=r"^state_indices: slot 2 appears twice"):
        _C.recurrent(q, k, v, g, beta, pool, o, scale=None, state_indices=idx)
    assert np.isnan(o).all()
    np.testing.assert_array_equal(pool, before)


def test_negative_state_indices_may_repeat():
    q, k, v, g, beta = _inputs(B=4, T=1)
    pool = np.zeros((2, HV, K, V), np.float32)
    o = flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=[-1, 1, -1, 0])
    assert np.all(o[[0, 2]] == 0) and np.isfinite(o).all()
    assert np.abs(pool).sum() > 0


def test_duplicate_state_indices_deterministic_rejection_every_time():
    """The issue's symptom: ten identical calls gave five results. Now every
    call is refused the same way."""
    q, k, v, g, beta = _inputs(B=8, T=3)
    pool = np.zeros((8, HV, K, V), np.float32)
    idx = np.array([0, 1, 2, 3, 4, 5, 6, 0], np.int64)
    for _ in range(10):
        with pytest.raises(ValueError, match="state_indices"):
            flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=idx)
    assert not pool.any()


def test_state_index_out_of_range_names_entry():
    q, k, v, g, beta = _inputs(B=2, T=1)
    pool = np.zeros((2, HV, K, V), np.float32)
    with pytest.raises(ValueError, match=r"^state_indices: entry 1 is 2, but the pool has 2 slots"):
        flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=[0, 2])


# --------------------------------------------------------------- aliasing ----

def test_issue_repro_state_pool_is_v():
    r = np.random.default_rng(4)
    q = r.standard_normal((1, 16, 4, 16)).astype(np.float32)
    v = r.standard_normal((1, 16, 16, 16)).astype(np.float32)
    g = np.full((1, 16, 16), -.1, np.float32)
    b = g * 0 + .5
    vv = v.copy()
    with pytest.raises(ValueError, match=r"^state and v overlap in memory"):
        flashqla.gdn_recurrent(q, q, vv, g, b, vv)
    np.testing.assert_array_equal(vv, v)


def test_inputs_may_alias_each_other():
    q, k, v, g, beta = _inputs()
    o, _ = flashqla.gdn_chunk(q, q, v, g, g * 0 + 0.5)   # q is k
    assert np.isfinite(o).all()


def _fwd_args():
    q, k, v, g, beta = _inputs()
    h0 = np.zeros((B, HV, K, V), np.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, o=_nan((B, T, HV, V)), initial_state=h0,
                final_state=_nan((B, HV, K, V)))


def _call_fwd(a):
    a = dict(a)
    pos = [a.pop(n) for n in ("q", "k", "v", "g", "beta", "o")]
    return _C.chunk_fwd(*pos, scale=None, **a)


def _bwd_args():
    q, k, v, g, beta = _inputs()
    r = np.random.default_rng(1)
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=r.standard_normal((B, T, HV, V)).astype(np.float32),
                dq=_nan((B, T, H, K)), dk=_nan((B, T, H, K)), dv=_nan((B, T, HV, V)),
                dg=_nan((B, T, HV)), dbeta=_nan((B, T, HV)),
                initial_state=np.zeros((B, HV, K, V), np.float32),
                dfinal_state=r.standard_normal((B, HV, K, V)).astype(np.float32),
                dinitial_state=_nan((B, HV, K, V)))


def _call_bwd(a):
    a = dict(a)
    pos = [a.pop(n) for n in ("q", "k", "v", "g", "beta", "do", "dq", "dk", "dv", "dg", "dbeta")]
    return _C.chunk_bwd(*pos, scale=None, **a)


def _written(a):
    return {n: a[n].copy() for n in ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta",
                                     "dinitial_state", "state") if n in a}


def _view_of(x, shape, dtype=np.float32, offset_elems=0):
    """A contiguous array of `shape` over x's memory (x must be large enough)."""
    flat = x.reshape(-1).view(np.uint8)
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    start = offset_elems * np.dtype(dtype).itemsize
    return flat[start:start + n].view(dtype).reshape(shape)


FWD_ALIASES = [
    # (written buffer, argument it overlaps, how)
    ("o", "v", "same"), ("o", "q", "part"), ("o", "g", "part"), ("o", "beta", "part"),
    ("o", "initial_state", "part"), ("final_state", "initial_state", "same"),
    ("final_state", "o", "part"), ("final_state", "k", "part"),
]


@pytest.mark.parametrize("written,other,how", FWD_ALIASES)
def test_forward_aliasing_rejected_naming_both(written, other, how):
    a = _fwd_args()
    big = np.zeros(200_000, np.float32)
    # put `other` at the start of `big` (with its values), `written` over it
    a[other] = _view_of(big, a[other].shape, a[other].dtype)
    a[other][...] = _fwd_args()[other]
    off = 0 if how == "same" else 3
    a[written] = _view_of(big, a[written].shape, a[written].dtype, off)
    before = big.copy()
    with pytest.raises(ValueError, match=r"overlap in memory") as e:
        _call_fwd(a)
    msg = str(e.value)
    assert msg.split(" overlap")[0] in (f"{written} and {other}", f"{other} and {written}"), msg
    np.testing.assert_array_equal(big, before)


BWD_ALIASES = [("dq", "q"), ("dk", "dq"), ("dv", "do"), ("dg", "g"), ("dbeta", "dg"),
               ("dinitial_state", "dfinal_state"), ("dinitial_state", "initial_state"),
               ("dv", "v")]


@pytest.mark.parametrize("written,other", BWD_ALIASES)
def test_backward_aliasing_rejected_naming_both(written, other):
    a = _bwd_args()
    big = np.zeros(200_000, np.float32)
    a[other] = _view_of(big, a[other].shape, a[other].dtype)
    a[other][...] = _bwd_args()[other]
    a[written] = _view_of(big, a[written].shape, a[written].dtype, 1)
    before = big.copy()
    with pytest.raises(ValueError, match=r"overlap in memory") as e:
        _call_bwd(a)
    assert written in str(e.value) and other in str(e.value)
    np.testing.assert_array_equal(big, before)


def test_recurrent_aliasing_state_and_o_and_indices():
    q, k, v, g, beta = _inputs(B=2, T=1)
    big = np.zeros(100_000, np.float32)
    pool = _view_of(big, (2, HV, K, V))
    o = _view_of(big, (2, 1, HV, V), offset_elems=10)
    with pytest.raises(ValueError, match=r"^o and state overlap in memory|^state and o overlap"):
        _C.recurrent(q, k, v, g, beta, pool, o, scale=None)
    # state_indices inside the pool
    pool2 = np.zeros((4, HV, K, V), np.float32)
    idx = pool2.reshape(-1)[:2].view(np.int32)  # 8 bytes inside the pool
    idx[...] = [0, 1]
    with pytest.raises(ValueError, match=r"state_indices"):
        _C.recurrent(q, k, v, g, beta, pool2, _nan((2, 1, HV, V)), scale=None, state_indices=idx)


def test_adjacent_buffers_do_not_count_as_overlap():
    a = _fwd_args()
    big = np.zeros(200_000, np.float32)
    n = a["v"].size
    a["v"] = _view_of(big, a["v"].shape)
    a["v"][...] = _fwd_args()["v"]
    a["o"] = _view_of(big, a["o"].shape, offset_elems=n)   # starts right after v
    _call_fwd(a)
    assert np.isfinite(a["o"]).all()


# -------------------------------------------------------------------- g ----

BAD_GATES = [(0.5, "0.5"), (np.inf, "inf"), (np.nan, "nan"), (1e-30, "1e-30")]


@pytest.mark.parametrize("value,shown", BAD_GATES, ids=[b[1] for b in BAD_GATES])
@pytest.mark.parametrize("op", ["chunk", "chunk_bwd", "recurrent"])
def test_positive_or_nan_gate_raises_naming_g(value, shown, op):
    q, k, v, g, beta = _inputs()
    g[1, 7, 1] = value
    pat = rf"^g: got {shown} at \[1, 7, 1\]; g is the log-space decay, g <= 0"
    if op == "chunk":
        with pytest.raises(ValueError, match=pat):
            flashqla.gdn_chunk(q, k, v, g, beta)
    elif op == "chunk_bwd":
        a = _bwd_args()
        a["g"] = g
        before = _written(a)
        with pytest.raises(ValueError, match=pat):
            _call_bwd(a)
        for n, x in before.items():
            np.testing.assert_array_equal(a[n], x)
    else:
        pool = np.zeros((B, HV, K, V), np.float32)
        with pytest.raises(ValueError, match=pat):
            flashqla.gdn_recurrent(q, k, v, g, beta, pool)
        assert not pool.any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_gate_check_in_every_gate_dtype(dtype):
    torch = pytest.importorskip("torch")
    q, k, v, g, beta = _inputs(dtype=np.float64 if dtype == "float64" else np.float32)
    tdt = getattr(torch, dtype)
    t = [torch.from_numpy(x).to(tdt) for x in (q, k, v, g, beta)]
    t[3][0, 3, 0] = 2.0
    with pytest.raises(ValueError, match=r"^g: got 2 at \[0, 3, 0\]"):
        flashqla.gdn_chunk(*t)
    t[3][0, 3, 0] = float("-inf")
    t[3][0, 4, 1] = -0.0
    o, _ = flashqla.gdn_chunk(*t)
    assert torch.isfinite(o).all()


def test_zero_and_minus_inf_gates_accepted():
    q, k, v, g, beta = _inputs()
    g[0, :5] = 0.0
    g[1, 3] = -np.inf
    g[1, 4] = -0.0
    o, _ = flashqla.gdn_chunk(q, k, v, g, beta)
    assert np.isfinite(o).all()
