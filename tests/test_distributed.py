"""flashqla.distributed.gdn_chunk (exact context parallelism) against the
single-process flashqla.gdn_chunk and the float64 reference.

The test starts its own processes (torch.multiprocessing.spawn): one gloo group
of 2 and one of 4 CPU processes, each running every case of its size, so
the whole file costs two process starts. Rank r gets tokens [r·TL, (r+1)·TL) of
one packed stream, computes o, final_state and, from the loss
Σ_r <do_r, o_r> + <dht, final_state_r>, the gradients of every input; the
parent puts the slices back together (final_state rows from the rank where
each sequence ends, initial-state gradients summed over ranks) and checks them
with the project's tolerance table (flashqla.reference.tolerance). A failing
rank records its error instead of leaving the others waiting in a collective.

The multi-GPU test (NCCL, bf16, K = V = 128) is marked gpu and needs 2 CUDA
devices."""

import datetime
import os
import re
import subprocess
import sys
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import flashqla  # noqa: E402
import flashqla.distributed  # noqa: E402
from gdn_testing import (GRAD_NAMES, assert_close, cast_inputs_torch, make_inputs,  # noqa: E402
                         reference_of, tolerance)

INPUT_NAMES = ("q", "k", "v", "g", "beta", "h0")

# name: (world, TL, H, HV, K, V, seqlens (None: one sequence), options)
# TL is never a multiple of 64; boundaries crossed by one sequence in the comment.
CASES = {
    # 0 crossings: a sequence boundary exactly at the rank boundary
    "w2-cross0": (2, 70, 2, 4, 16, 16, [30, 40, 70], {}),
    # 1 crossing, GVA 4, no initial state
    "w2-cross1-gva4-no-h0": (2, 70, 1, 4, 16, 16, [50, 90], {"h0": False}),
    # cu_seqlens=None: one sequence over both ranks, in-kernel l2norm, a scale
    "w2-one-seq-l2norm": (2, 100, 2, 4, 16, 24, None, {"l2norm": True, "scale": 0.4}),
    # float32 inputs and gates
    "w2-cross1-fp32": (2, 70, 2, 4, 32, 32, [1, 100, 39], {"dtype": "float32"}),
    # bfloat16 inputs (float32 gates): the corrections carry one more bf16 rounding
    "w2-cross1-bf16": (2, 90, 2, 4, 32, 32, [20, 150, 10], {"dtype": "bfloat16"}),
    # 3 crossings (45 | 90 | 135), empty and one-token sequences around it
    "w4-cross3": (4, 45, 2, 4, 16, 16, [5, 0, 170, 1, 4], {}),
    # 1 and 2 crossings, an empty sequence at a rank boundary, one of length 1
    "w4-mixed": (4, 45, 1, 2, 16, 16, [44, 1, 0, 101, 1, 0, 33], {}),
    # one sequence over all four ranks, no initial state, only the final state's gradient
    "w4-one-seq-no-h0-no-do": (4, 80, 2, 4, 16, 16, None, {"h0": False, "do": False}),
    # sequence boundaries on every rank boundary; only o's gradient
    "w4-cross0-no-dht": (4, 45, 2, 4, 16, 16, [45, 45, 45, 45], {"dht": False}),
}

# subgroups of a 4-process world: ranks {0, 1} and {2, 3}, each runs this world-2 case
SUBGROUP_CASE = (2, 70, 2, 4, 16, 16, [50, 90], {})


def _options(case):
    opts = {"dtype": "float64", "h0": True, "l2norm": False, "scale": None, "dht": True,
            "do": True}
    opts.update(case[7])
    return opts


def _case_inputs(case, seed, device="cpu"):
    world, TL, H, HV, K, V, seqlens, _ = case
    o = _options(case)
    inp = make_inputs(1, world * TL, H, HV, K, V, seed=seed, h0=o["h0"], seqlens=seqlens,
                      normalize_qk=not o["l2norm"], dht=o["dht"])
    if not o["do"]:
        inp["do"] = np.zeros_like(inp["do"])
    gate = "float32" if o["dtype"] == "bfloat16" else o["dtype"]
    return inp, cast_inputs_torch(inp, o["dtype"], gate, device=device)


# ---------------------------------------------------------------- workers ----

def _run_rank(case, t, rank, world, group, device):
    """This rank's slice through flashqla.distributed; returns its outputs and
    gradients (CPU tensors)."""
    o_opts = _options(case)
    TL = case[1]
    sl = slice(rank * TL, (rank + 1) * TL)
    x = {n: None if t[n] is None else
         (t[n][:, sl] if n != "h0" else t[n]).detach().clone().to(device).requires_grad_()
         for n in INPUT_NAMES}
    cu = t["cu_seqlens"]
    o, ht = flashqla.distributed.gdn_chunk(
        x["q"], x["k"], x["v"], x["g"], x["beta"], group=group, scale=o_opts["scale"],
        initial_state=x["h0"], output_final_state=True,
        cu_seqlens=None if case[6] is None else cu.to(device),
        use_qk_l2norm=o_opts["l2norm"])
    loss = 0  # each rank's own part of the global loss
    if o_opts["do"]:
        loss = loss + (o * t["do"][:, sl].to(device)).sum()
    if t["dht"] is not None:
        loss = loss + (ht * t["dht"].to(device)).sum()
    loss.backward()
    out = {"o": o.detach().cpu(), "ht": ht.detach().cpu()}
    for n, gname in zip(INPUT_NAMES, GRAD_NAMES):
        if x[n] is not None:
            out[gname] = x[n].grad.cpu()
    return out


def _bad_calls(rank, world):
    """Rejected calls raise on every rank before any collective (no rank waits)."""
    TL, H, HV, K = 8, 1, 2, 16
    q = torch.randn(1, TL, H, K, dtype=torch.float64)
    v = torch.randn(1, TL, HV, K, dtype=torch.float64)
    gb = torch.rand(1, TL, HV, dtype=torch.float64)
    msgs = {}
    calls = {
        "batch2": lambda: flashqla.distributed.gdn_chunk(
            q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
            -gb.expand(2, -1, -1), gb.expand(2, -1, -1)),
        "cu-local-end": lambda: flashqla.distributed.gdn_chunk(
            q, q, v, -gb, gb, cu_seqlens=torch.tensor([0, TL])),
        "h0-rows": lambda: flashqla.distributed.gdn_chunk(
            q, q, v, -gb, gb, cu_seqlens=torch.tensor([0, 3, world * TL]),
            initial_state=torch.zeros(1, HV, K, K, dtype=torch.float64)),
        "numpy": lambda: flashqla.distributed.gdn_chunk(
            q.numpy(), q.numpy(), v.numpy(), -gb.numpy(), gb.numpy()),
    }
    for name, call in calls.items():
        try:
            call()
            msgs[name] = None
        except (TypeError, ValueError) as e:
            msgs[name] = f"{type(e).__name__}: {e}"
    return msgs


def _worker(rank, world, backend, jobs, outdir):
    """jobs: list of (name, case, tensors, group ranks or None)."""
    os.environ["FLASHQLA_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # CI hosts whose hostname does not resolve
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{outdir}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    groups = {}
    for name, case, t, ranks in jobs:
        if ranks is not None:  # every rank creates every group, in one order
            for rs in ranks:
                groups[tuple(rs)] = dist.new_group(list(rs))
    for name, case, t, ranks in jobs:
        try:
            if ranks is None:
                results[name] = _run_rank(case, t, rank, world, None, device)
            else:
                mine = next(rs for rs in ranks if rank in rs)
                results[name] = _run_rank(case, t, mine.index(rank), len(mine),
                                          groups[tuple(mine)], device)
        except Exception:  # recorded; the other ranks fail or time out in the collective
            results[name] = {"error": traceback.format_exc()}
    if backend == "gloo":
        results["bad-calls"] = _bad_calls(rank, world)
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world, backend, jobs, outdir):
    mp.spawn(_worker, args=(world, backend, jobs, str(outdir)), nprocs=world, join=True)
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
            for r in range(world)]


# -------------------------------------------------------------- assembly ----

def _end_ranks(case):
    """Rank holding each sequence's final state (its last token; an empty
    sequence: the rank of its offset, the last rank for offset W·TL)."""
    world, TL, seqlens = case[0], case[1], case[6]
    cu = np.concatenate([[0], np.cumsum(seqlens if seqlens else [world * TL])])
    return [min(lo // TL, world - 1) if lo == hi else (hi - 1) // TL
            for lo, hi in zip(cu[:-1], cu[1:])]


def _assemble(case, per_rank):
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    ends = _end_ranks(case)
    out = {"o": torch.cat([res["o"] for res in per_rank], dim=1)}
    for r, res in enumerate(per_rank):  # rows of sequences ending elsewhere are zero
        other = [n for n, e in enumerate(ends) if e != r]
        assert torch.all(res["ht"][other] == 0), f"rank {r}: final-state rows {other} not zero"
    out["ht"] = torch.stack([per_rank[e]["ht"][n] for n, e in enumerate(ends)])
    for gname in GRAD_NAMES:
        if gname not in per_rank[0]:
            continue
        if gname == "dh0":  # summed over ranks (zero where a row is not used)
            out[gname] = sum(res[gname] for res in per_rank)
        else:
            out[gname] = torch.cat([res[gname] for res in per_rank], dim=1)
    return out


def _single_process(case, t):
    """flashqla.gdn_chunk on the whole stream with the same loss."""
    o_opts = _options(case)
    x = {n: None if t[n] is None else t[n].detach().clone().requires_grad_()
         for n in INPUT_NAMES}
    o, ht = flashqla.gdn_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"],
                               scale=o_opts["scale"], initial_state=x["h0"],
                               output_final_state=True, cu_seqlens=t["cu_seqlens"],
                               use_qk_l2norm=o_opts["l2norm"])
    loss = (o * t["do"]).sum()
    if t["dht"] is not None:
        loss = loss + (ht * t["dht"]).sum()
    loss.backward()
    out = {"o": o.detach(), "ht": ht.detach()}
    for n, gname in zip(INPUT_NAMES, GRAD_NAMES):
        if x[n] is not None:
            out[gname] = x[n].grad
    return out


def _check(case, t, got):
    o_opts = _options(case)
    single = _single_process(case, t)
    ref = reference_of(t, use_qk_l2norm=o_opts["l2norm"], scale=o_opts["scale"])
    assert set(got) == set(single), f"outputs {sorted(got)} != {sorted(single)}"
    for what in got:
        tol = tolerance(o_opts["dtype"], what)
        assert_close(f"{what} vs single process", got[what], single[what], tol)
        assert_close(f"{what} vs reference", got[what], ref[what], tol)


# ------------------------------------------------------------------ tests ----

@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """Runs every case once: world 2 and world 4 (with the subgroup case)."""
    inputs = {name: _case_inputs(case, seed=i)[1] for i, (name, case) in enumerate(CASES.items())}
    inputs["w4-subgroups"] = _case_inputs(SUBGROUP_CASE, seed=99)[1]
    results = {}
    for world in (2, 4):
        jobs = [(name, case, inputs[name], None)
                for name, case in CASES.items() if case[0] == world]
        if world == 4:
            jobs.append(("w4-subgroups", SUBGROUP_CASE, inputs["w4-subgroups"],
                         [[0, 1], [2, 3]]))
        per_rank = _spawn(world, "gloo", jobs, tmp_path_factory.mktemp(f"world{world}"))
        for name, _, _, _ in jobs + [("bad-calls", None, None, None)]:
            results[(world, name)] = [res[name] for res in per_rank]
    return inputs, results


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(gloo_results, name):
    inputs, results = gloo_results
    case = CASES[name]
    _check(case, inputs[name], _assemble(case, results[(case[0], name)]))


def test_subgroups_of_four_ranks(gloo_results):
    """group= a subgroup: ranks {0, 1} and {2, 3} each run one 2-rank stream."""
    inputs, results = gloo_results
    per_rank = results[(4, "w4-subgroups")]
    for pair in ((0, 1), (2, 3)):
        _check(SUBGROUP_CASE, inputs["w4-subgroups"],
               _assemble(SUBGROUP_CASE, [per_rank[r] for r in pair]))


@pytest.mark.parametrize("world", [2, 4])
def test_bad_inputs_raise_on_every_rank(gloo_results, world):
    _, results = gloo_results
    for rank, msgs in enumerate(results[(world, "bad-calls")]):
        assert msgs["batch2"].startswith("ValueError: q: expected batch size B == 1"), msgs
        assert msgs["cu-local-end"].startswith(
            f"ValueError: cu_seqlens: expected non-decreasing global offsets from 0 "
            f"to world_size·TL = {world * 8}"), msgs
        assert msgs["h0-rows"].startswith("ValueError: initial_state: expected shape [N=2"), msgs
        assert msgs["numpy"].startswith("TypeError: q: expected a torch.Tensor"), msgs


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        flashqla.distributed.gdn_chunk(x, x, x, x[..., 0], x[..., 0])


README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@pytest.mark.skipif(not os.path.exists(README), reason="README.md not beside tests/")
def test_readme_torchrun_example(tmp_path):
    """The README's cp_example.py, run as it says: torchrun --nproc_per_node=2."""
    text = open(README, encoding="utf-8").read()
    section = text.split("## Sequences across GPUs", 1)
    assert len(section) == 2, "README.md has no context-parallelism section"
    block = re.search(r"```python\n(.*?)```", section[1], flags=re.S)
    assert block and "torchrun --nproc_per_node=2 cp_example.py" in section[1][:block.start()]
    script = tmp_path / "cp_example.py"
    script.write_text(block.group(1))
    root = os.path.dirname(os.path.dirname(os.path.abspath(flashqla.__file__)))
    env = dict(os.environ, FLASHQLA_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root] + sys.path))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    number = r"([-+.e\d]+)"
    lines = re.findall(rf"rank (\d): o differs by {number}, final states \[[^\]]*\] by {number}",
                       run.stdout)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], run.stdout  # (lines may interleave)
    for _, do, dht in lines:  # float32 on the CPU backend, values of order 1
        assert float(do) < 1e-4 and float(dht) < 1e-4, run.stdout


# ------------------------------------------------------------- multi-GPU ----

GPU_CASES = {
    # bf16, Qwen-like heads, 1 and 3 crossings on 2 and 4 GPUs (as many as there are)
    "nccl-w2-bf16": (2, 1000, 2, 4, 128, 128, [300, 1500, 200], {"dtype": "bfloat16"}),
    "nccl-w4-bf16": (4, 700, 2, 4, 128, 128, [100, 2600, 100], {"dtype": "bfloat16"}),
    "nccl-w2-fp32-one-seq": (2, 333, 1, 2, 64, 64, None, {"dtype": "float32"}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_nccl_matches_single_process(name, tmp_path):
    case = GPU_CASES[name]
    if torch.cuda.device_count() < case[0] or not dist.is_nccl_available():
        pytest.skip(f"needs {case[0]} CUDA devices and NCCL")
    inp, t = _case_inputs(case, seed=5)
    per_rank = _spawn(case[0], "nccl", [(name, case, t, None)], tmp_path)
    got = _assemble(case, [res[name] for res in per_rank])
    o_opts = _options(case)
    tc = {n: None if x is None else x.cuda() for n, x in t.items()}
    single = {k: v.cpu() for k, v in _single_process(case, tc).items()}
    ref = reference_of(t, use_qk_l2norm=o_opts["l2norm"], scale=o_opts["scale"])
    for what in got:  # the GPU is held to the bf16 budget for every input dtype (test_gpu.py)
        tol = tolerance("bfloat16", what)
        assert_close(f"{what} vs reference", got[what], ref[what], tol)
        assert_close(f"{what} vs reference (single process)", single[what], ref[what], tol)
