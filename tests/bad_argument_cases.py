"""Bad arguments for every public function of flashqla (issue 9, item 6), as
named cases that test_bad_arguments.py runs in child processes (a crash then
fails one case instead of the test run).

Each case is CASES[id] = (argname, call): call() must raise TypeError or
ValueError whose message names `argname` (it starts with "argname:" or with
"argname and" / "... and argname overlap"). Run as a script it executes the
ids given on the command line (all without arguments) and prints one JSON
line per case before and after the call:

    {"id": ..., "start": true}
    {"id": ..., "exc": "ValueError", "msg": "..."}      ("exc": null if no exception)
"""

import json
import sys

import numpy as np

import flashqla
from flashqla import _C

B, T, H, HV, K, V = 2, 10, 1, 2, 16, 16


def _arrays(dtype=np.float32, B=B, T=T, K=K):
    r = np.random.default_rng(0)
    q = r.standard_normal((B, T, H, K)).astype(dtype)
    k = q.copy()
    v = r.standard_normal((B, T, HV, V)).astype(dtype)
    g = -np.abs(r.standard_normal((B, T, HV))).astype(np.float32)
    beta = np.full((B, T, HV), 0.5, np.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def _pool(P=B):
    return np.zeros((P, HV, K, V), np.float32)


class RaisingDLPack:
    """A producer whose __dlpack__ (or __dlpack_device__) raises."""

    def __init__(self, where="__dlpack__", exc=RuntimeError):
        self.where, self.exc = where, exc

    def __dlpack_device__(self):
        if self.where == "__dlpack_device__":
            raise self.exc("the device is gone")
        return (1, 0)

    def __dlpack__(self, **kw):
        raise self.exc("cannot export this one")


class WeirdDevice:
    def __dlpack_device__(self):
        return "cpu"

    def __dlpack__(self, **kw):
        raise AssertionError("never called")


# ------------------------------------------------------------ the callers ----

PUBLIC = {
    # name -> (function, names of its array arguments in order)
    "gdn_chunk": (flashqla.gdn_chunk, ("q", "k", "v", "g", "beta")),
    "gdn_chunk_fwd": (flashqla.gdn_chunk_fwd, ("q", "k", "v", "g", "beta")),
    "chunk_gated_delta_rule": (flashqla.chunk_gated_delta_rule, ("q", "k", "v", "g", "beta")),
    "gdn_recurrent": (flashqla.gdn_recurrent, ("q", "k", "v", "g", "beta", "state")),
}


def _public(fn_name, **changes):
    """A call of a public function with valid NumPy arguments, `changes`
    replacing some (keyword names of the function)."""
    fn, names = PUBLIC[fn_name]
    a = _arrays()
    if fn_name == "gdn_recurrent":
        a["state"] = _pool()
    kw = {}
    for n, x in changes.items():
        if n in names:
            a[n] = x
        else:
            kw[n] = x
    return lambda: fn(*(a[n] for n in names), **kw)


def _bwd(**changes):
    a = _arrays()
    o, ht, ctx = flashqla.gdn_chunk_fwd(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                        output_final_state=True)
    args = {"ctx": ctx, "do": np.ones_like(o), "dfinal_state": None}
    args.update(changes)
    return lambda: flashqla.gdn_chunk_bwd(args["ctx"], args["do"], args["dfinal_state"])


def _c_fwd(**changes):
    a = _arrays()
    a["o"] = np.empty((B, T, HV, V), np.float32)
    kw = {"scale": None}
    pos = ("q", "k", "v", "g", "beta", "o")
    for n, x in changes.items():
        (a if n in pos else kw)[n] = x
    return lambda: _C.chunk_fwd(*(a[n] for n in pos), **kw)


def _c_bwd(**changes):
    a = _arrays()
    a["do"] = np.ones((B, T, HV, V), np.float32)
    for n, s, dt in (("dq", (B, T, H, K), np.float32), ("dk", (B, T, H, K), np.float32),
                     ("dv", (B, T, HV, V), np.float32), ("dg", (B, T, HV), np.float32),
                     ("dbeta", (B, T, HV), np.float32)):
        a[n] = np.empty(s, dt)
    pos = ("q", "k", "v", "g", "beta", "do", "dq", "dk", "dv", "dg", "dbeta")
    kw = {"scale": None}
    for n, x in changes.items():
        (a if n in pos else kw)[n] = x
    return lambda: _C.chunk_bwd(*(a[n] for n in pos), **kw)


def _c_rec(**changes):
    a = _arrays()
    a["o"] = np.empty((B, T, HV, V), np.float32)
    a["state"] = _pool()
    pos = ("q", "k", "v", "g", "beta", "state", "o")
    kw = {"scale": None}
    for n, x in changes.items():
        (a if n in pos else kw)[n] = x
    return lambda: _C.recurrent(*(a[n] for n in pos), **kw)


def _jax(fn_name, **changes):
    def call():
        import jax.numpy as jnp
        import flashqla.jax as fqj
        a = {n: jnp.asarray(x) for n, x in _arrays().items()}
        names = ("q", "k", "v", "g", "beta")
        if fn_name == "gdn_recurrent":
            a["state"] = jnp.asarray(_pool())
            names = names + ("state",)
        kw = {}
        for n, x in changes.items():
            (a if n in names else kw)[n] = x
        fn = getattr(fqj, fn_name)
        return fn(*(a[n] for n in names), **kw)
    return call


def _torch_requires_grad_at_C():
    import torch
    a = _arrays()
    q = torch.from_numpy(a["q"]).requires_grad_()
    o = np.empty((B, T, HV, V), np.float32)
    _C.chunk_fwd(q, a["k"], a["v"], a["g"], a["beta"], o, scale=None)


# ----------------------------------------------------------------- cases ----

CASES = {}


def _add(case_id, argname, call):
    assert case_id not in CASES, case_id
    CASES[case_id] = (argname, call)


_BAD_DTYPES = {
    "object": lambda s: np.empty(s, object),
    "str": lambda s: np.full(s, "x"),
    "datetime": lambda s: np.zeros(s, "datetime64[s]"),
    "complex": lambda s: np.zeros(s, np.complex64),
    "int": lambda s: np.zeros(s, np.int32),
    "bool": lambda s: np.zeros(s, bool),
}
_SHAPES = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V), "g": (B, T, HV),
           "beta": (B, T, HV), "state": (B, HV, K, V), "initial_state": (B, HV, K, V)}
_BAD_SCALES = {"str": "x", "complex": 1 + 2j, "list": [1.0], "bool": True, "nan": float("nan"),
               "inf": float("inf"), "none-like-object": object()}
_BAD_CU = {"str": "abc", "str-list": ["a"], "float-fraction": [0.5, 10.0], "bool": [True, False],
           "2d": [[0, 10]], "ragged": [[0], [1, 2]], "object": np.array([0, None], object),
           "not-from-0": [1, 10], "decreasing": [0, 8, 5, 10], "not-to-T": [0, 5],
           "negative": [0, -1, 10], "empty": []}
_BAD_IDX = {"str-list": ["a"], "bool": np.array([True, False]), "duplicate": [1, 1],
            "out-of-range": [0, 2], "float-fraction": [0.5, 1.0], "2d": [[0, 1]],
            "wrong-length": [0, 1, 0]}

for _fn in PUBLIC:
    _names = PUBLIC[_fn][1]
    for _n in _names:
        _add(f"{_fn}-{_n}-None", _n, _public(_fn, **{_n: None}))
        _add(f"{_fn}-{_n}-list", _n, _public(_fn, **{_n: [[1.0]]}))
        for _dt, _make in _BAD_DTYPES.items():
            _add(f"{_fn}-{_n}-{_dt}", _n, _public(_fn, **{_n: _make(_SHAPES[_n])}))
        _add(f"{_fn}-{_n}-dlpack-raises", _n, _public(_fn, **{_n: RaisingDLPack()}))
        _add(f"{_fn}-{_n}-dlpack-device-raises", _n,
             _public(_fn, **{_n: RaisingDLPack("__dlpack_device__")}))
        _add(f"{_fn}-{_n}-dlpack-device-weird", _n, _public(_fn, **{_n: WeirdDevice()}))
    _add(f"{_fn}-K0", "q", _public(_fn, q=np.zeros((B, T, H, 0), np.float32),
                                   k=np.zeros((B, T, H, 0), np.float32)))
    for _s, _val in _BAD_SCALES.items():
        _add(f"{_fn}-scale-{_s}", "scale", _public(_fn, scale=_val))
    for _c, _val in _BAD_CU.items():   # (packed sequences: B = 1)
        _add(f"{_fn}-cu_seqlens-{_c}", "cu_seqlens",
             _public(_fn, cu_seqlens=_val, **_arrays(B=1),
                     **({"state": _pool(max(len(_val) - 1, 1) if isinstance(_val, list) else 1)}
                        if _fn == "gdn_recurrent" else {})))
    _add(f"{_fn}-g-positive", "g", _public(_fn, g=np.full((B, T, HV), 0.5, np.float32)))
    _add(f"{_fn}-g-nan", "g", _public(_fn, g=np.full((B, T, HV), np.nan, np.float32)))
    _add(f"{_fn}-k-shape", "k", _public(_fn, k=np.zeros((B, T, H, 8), np.float32)))
    _add(f"{_fn}-q-3d", "q", _public(_fn, q=np.zeros((B, T, K), np.float32)))

for _i, _val in _BAD_IDX.items():
    _add(f"gdn_recurrent-state_indices-{_i}", "state_indices",
         _public("gdn_recurrent", state_indices=_val, state=_pool(2)))


def _state_is_v():
    """The issue's state = v: a pool [P, HV, K, V] over v's memory."""
    a = _arrays(T=16)
    pool = a["v"].reshape(-1)[:HV * K * V].reshape(1, HV, K, V)
    return lambda: flashqla.gdn_recurrent(*(x[:1] for x in (a["q"], a["k"], a["v"], a["g"],
                                                            a["beta"])), pool)


_add("gdn_recurrent-state-is-v", "state", _state_is_v())

_add("gdn_recurrent-state-read-only", "state",
     _public("gdn_recurrent", state=np.lib.stride_tricks.as_strided(
         _pool(), writeable=False)))
_add("gdn_chunk-initial_state-shape", "initial_state",
     _public("gdn_chunk", initial_state=np.zeros((B, HV, K, V + 1), np.float32)))
_add("gdn_chunk-initial_state-str", "initial_state",
     _public("gdn_chunk", initial_state=np.full((B, HV, K, V), "x")))

# gdn_chunk_bwd
_add("gdn_chunk_bwd-ctx-None", "ctx", _bwd(ctx=None))
_add("gdn_chunk_bwd-do-None", "do", _bwd(do=None))
_add("gdn_chunk_bwd-do-shape", "do", _bwd(do=np.ones((B, T, HV, V + 1), np.float32)))
_add("gdn_chunk_bwd-do-str", "do", _bwd(do=np.full((B, T, HV, V), "x")))
_add("gdn_chunk_bwd-do-object", "do", _bwd(do=np.empty((B, T, HV, V), object)))
_add("gdn_chunk_bwd-do-list", "do", _bwd(do=[[1.0]]))
_add("gdn_chunk_bwd-do-dlpack-raises", "do", _bwd(do=RaisingDLPack()))
_add("gdn_chunk_bwd-dfinal_state-shape", "dfinal_state",
     _bwd(dfinal_state=np.ones((B, HV, K, V + 1), np.float32)))
_add("gdn_chunk_bwd-dfinal_state-str", "dfinal_state",
     _bwd(dfinal_state=np.full((B, HV, K, V), "x")))

# chunk_gated_delta_rule's own keywords
_add("chunk_gated_delta_rule-head_first", "head_first",
     _public("chunk_gated_delta_rule", head_first=True))

# flashqla.jax
for _fn in ("gdn_chunk", "gdn_recurrent"):
    for _n in ("q", "g", "beta"):
        _add(f"jax.{_fn}-{_n}-None", _n, _jax(_fn, **{_n: None}))
    _add(f"jax.{_fn}-scale-str", "scale", _jax(_fn, scale="x"))
    _add(f"jax.{_fn}-K0", "q", _jax(_fn, q=np.zeros((B, T, H, 0), np.float32),
                                    k=np.zeros((B, T, H, 0), np.float32)))
_add("jax.gdn_recurrent-state_indices-bool", "state_indices",
     _jax("gdn_recurrent", state_indices=np.array([True, False])))
_add("jax.gdn_chunk-cu_seqlens-str", "cu_seqlens", _jax("gdn_chunk", cu_seqlens="abc"))

# flashqla._C
for _name, _mk, _req in (("chunk_fwd", _c_fwd, ("q", "k", "v", "g", "beta", "o")),
                         ("chunk_bwd", _c_bwd, ("q", "do", "dq", "dg")),
                         ("recurrent", _c_rec, ("q", "g", "state", "o"))):
    for _n in _req:
        _add(f"_C.{_name}-{_n}-None", _n, _mk(**{_n: None}))
        _add(f"_C.{_name}-{_n}-object", _n, _mk(**{_n: np.empty(
            (_C_SHAPE := {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V),
                          "g": (B, T, HV), "beta": (B, T, HV), "o": (B, T, HV, V),
                          "do": (B, T, HV, V), "dq": (B, T, H, K), "dg": (B, T, HV),
                          "state": (B, HV, K, V)})[_n], object)}))
        _add(f"_C.{_name}-{_n}-str", _n, _mk(**{_n: np.full(_C_SHAPE[_n], "x")}))
        _add(f"_C.{_name}-{_n}-datetime", _n, _mk(**{_n: np.zeros(_C_SHAPE[_n], "datetime64[s]")}))
        _add(f"_C.{_name}-{_n}-dlpack-raises", _n, _mk(**{_n: RaisingDLPack()}))
        _add(f"_C.{_name}-{_n}-dlpack-raises-value", _n,
             _mk(**{_n: RaisingDLPack(exc=ValueError)}))
        _add(f"_C.{_name}-{_n}-dlpack-raises-buffer", _n,
             _mk(**{_n: RaisingDLPack(exc=BufferError)}))
    _add(f"_C.{_name}-num_threads-huge", "num_threads", _mk(num_threads=2 ** 40))
    _add(f"_C.{_name}-num_threads-negative", "num_threads", _mk(num_threads=-3))
    _add(f"_C.{_name}-num_threads-str", "num_threads", _mk(num_threads="x"))
    _add(f"_C.{_name}-num_threads-float", "num_threads", _mk(num_threads=2.5))
    for _s, _val in _BAD_SCALES.items():
        _add(f"_C.{_name}-scale-{_s}", "scale", _mk(scale=_val))
    _add(f"_C.{_name}-stream-str", "stream", _mk(stream="x"))
    _add(f"_C.{_name}-K0", "q", _mk(q=np.zeros((B, T, H, 0), np.float32)))
_add("_C.chunk_fwd-q-requires-grad", "q", _torch_requires_grad_at_C)
_add("_C.recurrent-state_indices-bool", "state_indices",
     _c_rec(state_indices=np.array([True, False])))
_add("_C.recurrent-state_indices-dup", "state_indices", _c_rec(state_indices=np.array([1, 1])))
_add("_C.recurrent-state-is-o", "o", (lambda p: _c_rec(state=p, o=p.reshape(-1)[:B * T * HV * V]
                                                        .reshape(B, T, HV, V)))(_pool()))
_add("_C.chunk_fwd-cu_seqlens-str", "cu_seqlens", _c_fwd(cu_seqlens=np.array(["a", "b"])))
_add("_C.workspace_bytes-B-huge", "B",
     lambda: _C.workspace_bytes("fwd", 2 ** 70, T, H, HV, K, V, B, "float32"))
_add("_C.workspace_bytes-op", "op", lambda: _C.workspace_bytes("sideways", B, T, H, HV, K, V, B,
                                                               "float32"))
_add("_C.workspace_bytes-op-None", "op", lambda: _C.workspace_bytes(None, B, T, H, HV, K, V, B,
                                                                    "float32"))
_add("_C.workspace_bytes-dtype", "dtype", lambda: _C.workspace_bytes("fwd", B, T, H, HV, K, V, B,
                                                                     "float8"))
_add("_C.workspace_bytes-K-str", "K", lambda: _C.workspace_bytes("fwd", B, T, H, HV, "x", V, B,
                                                                 "float32"))


def run(ids):
    for case_id in ids:
        print(json.dumps({"id": case_id, "start": True}), flush=True)
        exc = msg = None
        try:
            CASES[case_id][1]()
        except BaseException as e:  # noqa: BLE001 (reported, judged by the parent)
            exc, msg = type(e).__name__, str(e)
        print(json.dumps({"id": case_id, "exc": exc, "msg": msg}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1:] or list(CASES))
