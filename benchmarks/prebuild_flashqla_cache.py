#!/usr/bin/env python3
"""Build FlashQLA 0.1.3's TileLang kernel cache for bench_gpu.py's rows on a machine WITHOUT a GPU,
and pack it small, so that the H200 run finds every FlashQLA kernel compiled (no JIT in the device
call). What it compiles and why this is valid: benchmarks/NOTES.md, "FlashQLA's JIT".

    # once: FlashQLA, TileLang and TileLang's dependencies for THIS machine's Python (not the
    # device's; the cache itself is Python-independent), outside any shared venv:
    python3 -m pip install --target /tmp/fq_site --no-deps flash-qla==0.1.3 tilelang==0.1.15 \\
        apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 cloudpickle psutil tqdm
    PYTHONPATH=/tmp/fq_site nice python3 benchmarks/prebuild_flashqla_cache.py     # ~20-40 min, 2 cores
    # -> .peers/flashqla_cache.tar.xz (~2 MB); carry ".peers" in the device call (dev/gpu_check.sh
    #    unpacks it into TILELANG_CACHE_DIR)

    --list          only trace: print the kernels (TileLang factory + static arguments) each row
                    needs and which rows share them; compiles nothing (~1 min)
    --rows          fwd,bwd,train (default all three; decode needs no FlashQLA kernel)
    --cache DIR     TileLang cache directory (default /tmp/flashqla_tilelang_cache)
    --pack FILE     archive to write (default .peers/flashqla_cache.tar.xz); --no-pack to skip

How: FlashQLA's host code runs for real, on CPU tensors of each row's shapes (uninitialised: the
values never reach a kernel), through the very calls bench_gpu.py times (its FlashQla adapter:
inference forward, backward alone from the autograd forward's context, training step, and the
reference-check shape). torch is told it sees an H200 (132 SMs, compute capability 9.0), which is
what FlashQLA's decisions read (intra-card CP split from 132 SMs, block_DV from 0.7 x 132 CTAs,
the sm90 kernel family). Every TileLang kernel factory call then compiles for real (TileLang
lowering + nvcc 13.0 for sm_90a, target {"kind": "cuda", "arch": "sm_90a"} exactly as TileLang
auto-detects on the H200) into the disk cache; the kernel launches themselves are replaced by
no-ops. TileLang's cache key is a hash of the kernel's TIR, the target, the execution backend
(tvm_ffi), the pass configs and TileLang's version and platform (x86_64): nothing of the GPU,
the driver, Python, torch or the install path, so the H200 finds these entries. The archive
holds only the <version>/<platform>/kernels/<key>/ entries the rows use (not TileLang's
cuda-binaries/ nvcc cache, which a hit never reads).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tarfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# An H200 as torch reports it (what FlashQLA 0.1.3 reads: multi_processor_count, capability).
H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                             total_memory=150754820096, L2_cache_size=60 * 2 ** 20)


def pretend_h200(torch):
    """Make FlashQLA's and TileLang's device queries see an H200 while every tensor stays on
    the CPU."""
    torch.cuda.get_device_properties = lambda *a, **k: H200
    torch.cuda.get_device_capability = lambda *a, **k: (H200.major, H200.minor)
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()     # flash_qla.utils.input_guard
    from tilelang.contrib import nvcc
    real = nvcc.get_target_compute_version

    def compute_version(target=None):       # import-time query without a target: the H200's
        try:
            return real(target)
        except ValueError:
            return "%d.%d" % (H200.major, H200.minor)
    nvcc.get_target_compute_version = compute_version


class Tracer:
    """Records every TileLang kernel factory call (name, static arguments); compiles it unless
    listing; kernel launches do nothing."""

    def __init__(self, compile_):
        self.compile = compile_
        self.calls = []
        jit = importlib.import_module("tilelang.jit")
        from tilelang.jit.kernel import JITKernel
        real_call = jit.JITImpl.__call__
        tracer = self

        def factory_call(impl, *args, **kwargs):
            fn = getattr(impl, "func", None)
            name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "?")
            rec = {"kernel": name, "static": " ".join([repr(a) for a in args] +
                                                     ["%s=%r" % kv for kv in sorted(kwargs.items())])}
            tracer.calls.append(rec)
            if not tracer.compile:
                return lambda *a, **k: None
            t0 = time.time()
            kernel = real_call(impl, *args, **kwargs)
            rec["s"] = time.time() - t0
            rec["path"] = getattr(kernel, "_tilelang_cache_path", None)
            return kernel

        jit.JITImpl.__call__ = factory_call
        JITKernel.__call__ = lambda self, *a, **k: None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="trace only; compile nothing")
    p.add_argument("--rows", default="fwd,bwd,train")
    p.add_argument("--cache", default="/tmp/flashqla_tilelang_cache")
    p.add_argument("--pack", default=os.path.join(ROOT, ".peers", "flashqla_cache.tar.xz"))
    p.add_argument("--no-pack", action="store_true")
    p.add_argument("--json", default=None, help="write the per-row kernel lists to this file")
    args = p.parse_args(argv)

    os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(args.cache)
    import torch
    try:
        import tilelang  # noqa: F401
    except ImportError as e:
        sys.exit("prebuild: TileLang is not importable (%s); see the header for the pip command" % e)
    pretend_h200(torch)          # before flash_qla: its modules query the device when imported
    tracer = Tracer(compile_=not args.list)
    try:
        import flash_qla  # noqa: F401
    except ImportError as e:
        sys.exit("prebuild: FlashQLA is not importable (%s); see the header for the pip command" % e)
    import flash_qla.ops.gated_delta_rule.chunk as fq_chunk
    import flash_qla.ops.gated_delta_rule.chunk.cp.context as fq_context

    def cpu_cu_seqlens(batch_size, num_tokens, device_idx):   # FlashQLA makes cu_seqlens "cuda:<i>"
        return torch.arange(batch_size + 1, dtype=torch.int32) * num_tokens
    fq_chunk._create_cu_seqlens = fq_context._create_cu_seqlens = cpu_cu_seqlens

    sys.path.insert(0, HERE)
    import bench_gpu as bg
    bg.DEVICE = "cpu"
    lib = bg.FlashQla()
    print("prebuild: FlashQLA %s, TileLang %s, cache %s (%d kernels), %s" % (
        lib.version, lib.tilelang_version, args.cache, len(lib.cache_entries()),
        "listing only" if args.list else "compiling"), flush=True)

    want = [p_ for p_ in args.rows.split(",") if p_ in ("fwd", "bwd", "train")]
    jobs = [(p_, s, bg.spec_label(p_, s)) for p_, s in bg.plan_rows(",".join(want))]
    jobs.append(("train", bg.CHECK_SHAPE, "reference check (train 2/4 1x256)"))
    seen, per_row, paths, t_all = {}, [], set(), time.time()
    for pass_, spec, label in jobs:
        tracer.calls.clear()
        t0 = time.time()
        t = bg.chunk_sets(pass_, spec, 1, device="cpu", empty=True)[0]
        if pass_ == "fwd":
            lib.fwd(t)
        elif pass_ == "bwd":
            lib.bwd(t, lib.bwd_prepare(t))
        else:
            lib.train(t, bg.leaves_of(t))
        kernels = list(dict.fromkeys((c["kernel"], c["static"]) for c in tracer.calls))
        new = [k for k in kernels if k not in seen]
        for c in tracer.calls:
            seen.setdefault((c["kernel"], c["static"]), label)
            if c.get("path"):
                paths.add(c["path"])
        per_row.append({"row": label, "launches": len(tracer.calls), "kernels": [" ".join(k) for k in kernels],
                        "new": len(new), "seconds": round(time.time() - t0, 1)})
        print("%-36s %2d launches, %2d kernels, %2d new (%.1f s)" % (
            label, len(tracer.calls), len(kernels), len(new), time.time() - t0), flush=True)
        for k in kernels:
            print("    %s %s %s" % ("NEW" if k in new else "   ", k[0], k[1]))
    print("prebuild: %d distinct kernels for %d rows, %.0f s" % (len(seen), len(jobs), time.time() - t_all))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": per_row, "kernels": [{"kernel": k, "static": s, "first_row": r}
                                                    for (k, s), r in seen.items()]}, f, indent=1)
    if args.list or args.no_pack:
        return 0
    missing = [c for c in paths if not os.path.isdir(c)]
    if missing or len(paths) != len(seen):
        print("prebuild: WARNING: %d kernels without a cache entry (%d entries for %d kernels)" % (
            len(missing), len(paths), len(seen)))
    os.makedirs(os.path.dirname(os.path.abspath(args.pack)), exist_ok=True)
    cache_root = os.path.abspath(args.cache)
    tmp = args.pack + ".tmp"
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for path in sorted(paths):
            tar.add(path, arcname=os.path.relpath(path, cache_root))
    os.replace(tmp, args.pack)
    print("prebuild: wrote %s, %d kernel entries, %.2f MB (unpack into TILELANG_CACHE_DIR)" % (
        args.pack, len(paths), os.path.getsize(args.pack) / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
