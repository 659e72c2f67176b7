"""One request never poisons another, on the CPU backend (issue 9, items 1-3).

- NaN isolation and causality: a NaN placed in one input entry (q, k, v,
  beta, the initial state or the upstream gradient do) may make NaN only the
  outputs and gradients that depend on that entry in the exact math. The
  float64 token-by-token reference (flashqla.reference) is that exact math:
  it has no structural zeros to multiply, so its NaN pattern is the allowed
  one. Wherever the reference is finite, flashqla must be finite and close
  to it: other batch rows, other packed sequences, other value heads, outputs
  before the NaN token (forward) and the gradients that do not depend on it
  (backward: dq before the token, dv everywhere for a NaN in v, ...).
  (A NaN in g is rejected on the CPU, see test_robustness.py.)
- Full resets: g = -inf (any g <= FQ_GATE_RESET = -100) is a legal gate,
  alpha = 0; the chunked forward and backward stay finite and match the
  reference, wherever the resets fall in the chunks.
"""

import warnings

import numpy as np
import pytest

import flashqla
from gdn_testing import assert_finite_where_reference, make_inputs, reference_of, rel_error, to_f64, tolerance

NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _cast(inp, dt):
    return {n: (None if x is None else (x if n == "cu_seqlens" else x.astype(dt)))
            for n, x in inp.items()}


def _run(a):
    """flashqla forward + backward on NumPy arrays: dict of the NAMES."""
    cu = a["cu_seqlens"]
    o, ht, ctx = flashqla.gdn_chunk_fwd(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                        initial_state=a["h0"], output_final_state=True,
                                        cu_seqlens=cu)
    grads = flashqla.gdn_chunk_bwd(ctx, a["do"], a["dht"])
    return dict(zip(NAMES, (o, ht) + tuple(grads)))


def _reference(a):
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return reference_of(a)


# (field, index into that field's array) for B=2 rows of T=150 tokens, H=2, HV=4:
# chunk interior, first token of a chunk, early token, last token of a chunk.
NAN_SPOTS = [
    ("v", (0, 100, 1, 3)), ("v", (1, 64, 2, 0)), ("v", (0, 3, 0, 5)),
    ("k", (0, 100, 1, 7)), ("k", (1, 127, 0, 1)),
    ("q", (0, 100, 1, 2)), ("q", (1, 64, 0, 0)),
    ("beta", (0, 100, 1)), ("beta", (1, 63, 3)),
    ("h0", (1, 2, 3, 4)),
    ("do", (0, 100, 1, 3)), ("do", (1, 0, 2, 2)),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("K", [16, 32])   # 16: padded to 32 columns inside the CPU kernels
@pytest.mark.parametrize("field,idx", NAN_SPOTS, ids=[f"{f}{list(i)}" for f, i in NAN_SPOTS])
def test_nan_reaches_only_what_depends_on_it(dtype, K, field, idx):
    inp = make_inputs(2, 150, 2, 4, K, K, seed=2, dht=True)
    inp[field][idx] = np.nan
    a = _cast(inp, np.dtype(dtype))
    out, ref = _run(a), _reference(a)
    for name in NAMES:
        assert_finite_where_reference(name, out[name], ref[name], tolerance(dtype, name))
    # the other batch row is untouched, in every output
    other = 1 - idx[0]
    for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        assert np.isfinite(to_f64(out[name])[other]).all(), name


@pytest.mark.parametrize("field", ["v", "k", "beta"])
def test_nan_in_one_packed_sequence_stays_there(field):
    """Packed sequences (cu_seqlens) share the token axis: a NaN in sequence
    1 leaves sequences 0 and 2 exact; inside sequence 1, o before the token
    stays finite."""
    seqlens = [70, 90, 40]
    inp = make_inputs(1, sum(seqlens), 1, 2, 16, 16, seed=3, seqlens=seqlens, dht=True)
    t = 70 + 50
    if field == "beta":
        inp[field][0, t, 1] = np.nan
    elif field == "k":
        inp[field][0, t, 0, 3] = np.nan
    else:
        inp[field][0, t, 1, 3] = np.nan
    a = _cast(inp, np.float32)
    out, ref = _run(a), _reference(a)
    for name in NAMES:
        assert_finite_where_reference(name, out[name], ref[name], tolerance("float32", name))
    o = to_f64(out["o"])
    assert np.isfinite(o[0, :t]).all() and np.isfinite(o[0, 160:]).all()


def test_issue_repro_nan_row_does_not_reach_other_row():
    q = np.zeros((2, 64, 1, 16), np.float32)
    v = np.ones((2, 64, 1, 16), np.float32)
    g = np.zeros((2, 64, 1), np.float32)
    b = np.full((2, 64, 1), .5, np.float32)
    v[0, 10] = np.nan
    k = np.full((2, 64, 1, 16), .25, np.float32)
    o, _ = flashqla.gdn_chunk(k, k, v, g, b)
    assert np.isfinite(o[1]).all()
    assert np.isfinite(o[0, :10]).all() and not np.isfinite(o[0, 10:]).any()


def test_recurrent_nan_isolation():
    inp = make_inputs(3, 20, 1, 2, 16, 16, seed=4)
    inp["v"][1, 7, 0, 2] = np.nan
    a = _cast(inp, np.float32)
    pool = a["h0"].copy()
    o = flashqla.gdn_recurrent(a["q"], a["k"], a["v"], a["g"], a["beta"], pool)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        ref_o, ref_pool = flashqla.reference.recurrent(a["q"], a["k"], a["v"], a["g"],
                                                       a["beta"], a["h0"])
    assert_finite_where_reference("o", o, ref_o, tolerance("float32", "o"))
    assert_finite_where_reference("state", pool, ref_pool, tolerance("float32", "ht"))
    assert np.isfinite(o[[0, 2]]).all() and np.isfinite(pool[[0, 2]]).all()
    assert np.isfinite(o[1, :7]).all() and np.isfinite(o[1, :, 1]).all()


# ------------------------------------------------------------ full resets ----

def _reset_cases():
    """(name, function(g) that writes -inf-like gates into g [B, T, HV])."""
    def mid(g):
        g[0, 30, 0] = -np.inf
    def two_in_chunk(g):
        g[0, 10, 1] = -np.inf
        g[0, 50, 1] = -np.inf
    def chunk_edges(g):
        g[0, 0, 0] = -np.inf
        g[0, 63, 1] = -np.inf
        g[1, 64, :] = -np.inf
        g[1, 127, 0] = -np.inf
    def runs(g):
        g[1, 70:75, 1] = -np.inf
        g[0, 100:150, 0] = -np.inf
    def finite_huge(g):
        g[1, 20, 0] = -1e30          # finite, far below FQ_GATE_RESET
        g[0, 90, 1] = -150.0
        g[0, 91, 1] = -100.0         # exactly the threshold
        g[1, 40, 1] = -99.0          # just above: an ordinary (tiny) decay
    def every_token(g):
        g[1, :, 1] = -np.inf
    return [("mid", mid), ("two-in-chunk", two_in_chunk), ("chunk-edges", chunk_edges),
            ("runs", runs), ("finite-huge", finite_huge), ("every-token", every_token)]


RESETS = _reset_cases()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name,put", RESETS, ids=[r[0] for r in RESETS])
def test_full_reset_gates_match_reference(dtype, name, put):
    inp = make_inputs(2, 150, 1, 2, 16, 16, seed=5, dht=True)
    put(inp["g"])
    a = _cast(inp, np.dtype(dtype))
    out, ref = _run(a), _reference(a)
    for n in NAMES:
        r = ref[n]
        assert np.isfinite(r).all(), f"reference {n} is not finite"
        x = to_f64(out[n])
        assert np.isfinite(x).all(), f"{n}: {int((~np.isfinite(x)).sum())} non-finite values"
        err = rel_error(x, r)
        assert err <= tolerance(dtype, n), f"{n}: rel error {err:.3e}"
    # dg at a reset is 0 (alpha = 0 exactly); the reference agrees
    resets = to_f64(a["g"]) <= -100.0
    assert np.all(to_f64(out["dg"])[resets] == 0.0)


@pytest.mark.parametrize("name,put", RESETS[:3], ids=[r[0] for r in RESETS[:3]])
def test_full_reset_gates_varlen_bf16_and_recurrent(name, put):
    inp = make_inputs(2, 150, 1, 2, 32, 32, seed=6, dht=True)
    put(inp["g"])
    import torch
    from gdn_testing import cast_inputs_torch
    t = cast_inputs_torch(inp, "bfloat16")
    o, ht = flashqla.gdn_chunk(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"],
                               output_final_state=True)
    ref = _reference({n: (None if x is None else to_f64(x)) for n, x in t.items()})
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_error(o, ref["o"]) <= tolerance("bfloat16", "o")
    assert rel_error(ht, ref["ht"]) <= tolerance("bfloat16", "ht")
    # the recurrent step over the same tokens (fp32)
    a = _cast(inp, np.float32)
    pool = a["h0"].copy()
    o2 = flashqla.gdn_recurrent(a["q"], a["k"], a["v"], a["g"], a["beta"], pool)
    r32 = _reference(a)
    assert rel_error(o2, r32["o"]) <= tolerance("float32", "o")
    assert rel_error(pool, r32["ht"]) <= tolerance("float32", "ht")
