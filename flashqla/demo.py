"""python -m flashqla.demo — run the gated delta rule on this machine.

Runs a realistic chunked forward and backward (the prefill / training step of
a Gated DeltaNet layer) on the GPU when a CUDA device, PyTorch and the CUDA
build of flashqla are present, otherwise on the CPU backend; checks the
result against the float64 reference on a small slice; prints time and
throughput. Exit status 1 if the check fails.

    python -m flashqla.demo                 # defaults for the hardware found
    python -m flashqla.demo --device cpu --tokens 2048 --heads 2/4 --dim 128

Proper benchmarks (CUDA-graph timing, side by side with FLA) live in
benchmarks/; this is a smoke test with numbers.
"""

import argparse
import functools
import os
import sys
import time

import numpy as np

import flashqla
from flashqla import reference

CHECK_TOKENS = 200   # the slice checked against the (slow) float64 reference
CHECK_HEADS = 2      # value heads in that slice


def make_inputs(rng, B, T, H, HV, K, V):
    """float32 NumPy inputs shaped like a real model's: q, k L2-normalised,
    beta = sigmoid(randn), g = -A_h softplus(0.5 randn + 1), A_h in [0, 16]."""
    q = rng.standard_normal((B, T, H, K), dtype=np.float32)
    k = rng.standard_normal((B, T, H, K), dtype=np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V), dtype=np.float32)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, HV), dtype=np.float32)))
    a = np.linspace(0, 16, HV, dtype=np.float32)
    g = -a * np.log1p(np.exp(0.5 * rng.standard_normal((B, T, HV), dtype=np.float32) + 1))
    h0 = 0.5 * rng.standard_normal((B, HV, K, V), dtype=np.float32)
    do = rng.standard_normal((B, T, HV, V), dtype=np.float32)
    return dict(q=q, k=k, v=v, g=g.astype(np.float32), beta=beta.astype(np.float32), h0=h0, do=do)


def gpu_available():
    if not flashqla.cuda_available():
        return False, "flashqla was built without CUDA"
    try:
        import torch
    except ImportError:
        return False, "PyTorch is not installed (the GPU demo uses torch tensors)"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, torch.cuda.get_device_name()


class Runner:
    """Runs forward / backward with one framework and times them."""

    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype
        if device == "cuda":
            import torch
            self.torch = torch

    def put(self, x, dtype=None):
        if self.device == "cpu":
            return x
        t = self.torch.from_numpy(x).to("cuda")
        return t.to(getattr(self.torch, dtype)) if dtype else t

    def get(self, x):
        if x is None or self.device == "cpu":
            return x
        return x.float().cpu().numpy()

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def fwd_bwd(self, d, want_bwd=True):
        o, ht, ctx = flashqla.gdn_chunk_fwd(d["q"], d["k"], d["v"], d["g"], d["beta"],
                                            initial_state=d["h0"], output_final_state=True)
        grads = flashqla.gdn_chunk_bwd(ctx, d["do"]) if want_bwd else None
        return o, ht, grads

    def timed(self, fn, repeats):
        fn()  # warm-up
        self.sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))


def on_device(runner, inp):
    dt = runner.dtype
    return {n: runner.put(x, None if n in ("g", "beta", "h0") else dt) for n, x in inp.items()}


def check(runner, inp):
    """Forward + backward on a slice (first CHECK_TOKENS tokens, first
    CHECK_HEADS value heads with their q/k heads) against the reference."""
    H, HV = inp["q"].shape[2], inp["v"].shape[2]
    G = HV // H
    hv = max(CHECK_HEADS, G) // G * G
    h = hv // G
    T = min(CHECK_TOKENS, inp["q"].shape[1])
    sl = {n: np.ascontiguousarray(x[:1, :T, :h] if n in ("q", "k") else
                                  x[:1, :hv] if n == "h0" else x[:1, :T, :hv])
          for n, x in inp.items()}
    d = on_device(runner, sl)
    o, ht, grads = runner.fwd_bwd(d)
    x = {n: np.asarray(runner.get(d[n]), np.float64) for n in sl}
    o_ref, ht_ref = reference.forward(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                      initial_state=x["h0"])
    g_ref = reference.backward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"],
                               initial_state=x["h0"])
    # the project's tolerance table (DESIGN §3), rel = ||out - ref|| / ||ref||
    tol = functools.partial(reference.tolerance, runner.dtype)
    rel = reference.rel_error
    rows = [("o", rel(runner.get(o), o_ref), tol("o")),
            ("final_state", rel(runner.get(ht), ht_ref), tol("ht"))]
    for name, got, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, g_ref):
        rows.append((name, rel(runner.get(got), ref), tol(name)))
    return rows, T, hv


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashqla.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tokens", type=int, default=None, help="sequence length T (one sequence)")
    ap.add_argument("--heads", default=None, help="H/HV, q/k heads / value heads")
    ap.add_argument("--dim", type=int, default=128, help="head dim K = V")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-backward", action="store_true")
    args = ap.parse_args(argv)

    ok, what = gpu_available()
    device = args.device
    if device == "auto":
        device = "cuda" if ok else "cpu"
    elif device == "cuda" and not ok:
        print(f"flashqla demo: no GPU run possible: {what}", file=sys.stderr)
        return 2
    if device == "cuda":
        T, heads, dtype, repeats = 32768, "16/32", "bfloat16", 20
        where = f"GPU: {what}"
    else:
        T, heads, dtype, repeats = 8192, "4/8", "float32", 3
        threads = flashqla._C.default_threads()
        where = f"CPU backend, {threads} thread{'s' if threads > 1 else ''} " \
                f"(FLASHQLA_NUM_THREADS={os.environ.get('FLASHQLA_NUM_THREADS', 'unset')})"
        if not ok and args.device == "auto":
            where += f"; no GPU run because {what}"
    T = args.tokens or T
    heads = args.heads or heads
    dtype = args.dtype or dtype
    repeats = args.repeats or repeats
    if device == "cpu" and dtype != "float32":
        print("flashqla demo: the CPU demo uses NumPy arrays, float32 only", file=sys.stderr)
        return 2
    H, HV = (int(x) for x in heads.split("/"))
    K = V = args.dim

    print(f"flashqla {flashqla.__version__} demo on {where}")
    print(f"gated delta rule, one sequence of T={T} tokens, H={H} q/k heads, HV={HV} value "
          f"heads, K=V={K}, {dtype} inputs, initial state given, final state returned")
    runner = Runner(device, dtype)
    inp = make_inputs(np.random.default_rng(0), 1, T, H, HV, K, V)

    rows, ct, chv = check(runner, inp)
    print(f"\ncheck against the float64 reference (first {ct} tokens, {chv} value heads):")
    passed = True
    for name, err, tol in rows:
        good = err <= tol
        passed &= good
        print(f"  {name:<12} rel error {err:9.2e}   (tolerance {tol:.0e})  "
              f"{'ok' if good else 'FAIL'}")

    d = on_device(runner, inp)
    fwd = runner.timed(lambda: runner.fwd_bwd(d, want_bwd=False), repeats)
    print(f"\ntimings (median of {repeats} after a warm-up; host-timed, launch overhead included):")
    work = T * HV
    print(f"  forward            {fwd * 1e3:9.2f} ms   {T / fwd / 1e6:8.3f} M tokens/s   "
          f"{work / fwd / 1e6:8.3f} M token-heads/s")
    if not args.no_backward:
        both = runner.timed(lambda: runner.fwd_bwd(d), repeats)
        print(f"  forward + backward {both * 1e3:9.2f} ms   {T / both / 1e6:8.3f} M tokens/s   "
              f"{work / both / 1e6:8.3f} M token-heads/s")
    print("\nresult:", "PASS" if passed else "FAIL (see the check above)")
    print("benchmarks against FLA and the published numbers: see benchmarks/ and benchmarks/results/")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
