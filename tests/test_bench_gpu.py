"""benchmarks/bench_gpu.py without a GPU.

Its --dry-run goes through the same row plan, results JSON, tables, plot and FLA child process
(started with FLA_DISABLE_BACKEND_DISPATCH=1) as a device run, on fake numbers, so the harness
keeps working between the rare GPU runs. The timing itself needs the H200."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_gpu.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_bench(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    out = subprocess.run([sys.executable, BENCH] + args, capture_output=True, text=True, timeout=600,
                         env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """One dry run of every pass; rows from the 21st on are marked skipped (the time-budget path)."""
    tmp = tmp_path_factory.mktemp("bench_dry")
    table = tmp / "table.txt"
    stdout = run_bench(["--dry-run", "--out", str(tmp), "--table-file", str(table), "--dry-skip-after", "20"], tmp)
    paths = glob.glob(str(tmp / "dryrun_*.json"))
    assert len(paths) == 1, os.listdir(tmp)
    with open(paths[0]) as f:
        res = json.load(f)
    return res, stdout, table.read_text(), paths[0]


def test_plan_rows_selects_passes(bench):
    counts = {p: len(bench.plan_rows(p)) for p in ("fwd", "bwd", "train", "decode", "verify")}
    # ANCHORS.md's rows plus issue 11's: 3 fused-gate prefill, 2 [V, K] decode, 3 verify, and
    # 2 decode rows without pool indices (FLA's own call)
    assert counts == {"fwd": 15, "bwd": 5, "train": 5, "decode": 10, "verify": 3}
    plan = bench.plan_rows("all")
    assert len(plan) == 38
    labels = [bench.spec_label(p, s) for p, s in plan]
    assert "fwd+gates 16/32 1x8192" in labels and "decode 16/32 N=64 T=1 vk" in labels
    assert "decode 16/32 N=1 T=1 noidx" in labels and "decode 16/32 N=1 T=1" in labels
    assert "verify 16/32 N=64 T=4" in labels and len(set(labels)) == len(labels)
    # each backward shape's "bwd" and "train" rows are adjacent (they share FlashQLA's kernels)
    labels = [bench.spec_label(p, s) for p, s in plan]
    i = labels.index("bwd 4/8 1x32768")
    assert labels[i + 1] == "train 4/8 1x32768"
    assert [p for p, _ in bench.plan_rows("train,fwd")][:1] == ["fwd"]
    with pytest.raises(ValueError, match="unknown pass"):
        bench.plan_rows("fwd,backward")
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "nope"])


def test_time_budget_counts_from_start(bench):
    now = [100.0]
    b = bench.Budget(30, clock=lambda: now[0])
    assert not b.out() and b.left() == 30
    now[0] = 129.0
    assert not b.out()
    now[0] = 130.5
    assert b.out() and b.left() < 0
    unlimited = bench.Budget(0, clock=lambda: now[0])
    assert not unlimited.out() and unlimited.left() == float("inf")


def test_merge_fla_keeps_the_other_columns(bench):
    spec = bench.FWD_ROWS[0]
    row = bench.new_row("fwd", spec)
    row.update(flashqla_ms=1.0, flash_qla_ms=1.3)
    results = {"rows": [row, bench.new_row("fwd", bench.FWD_ROWS[1])], "versions": {}}
    child = bench.new_row("fwd", spec)            # the FLA process's row: flash_qla_ms None
    child.update(label=bench.spec_label("fwd", spec), fla_ms=2.0, fla_first_call_s=3.0)
    child["peak_extra_mib"]["fla"] = 123.0
    bench.merge_fla(results, {"rows": [child], "versions": {"fla": "0.6.0"}, "dispatch_disabled": True})
    r0, r1 = results["rows"]
    assert (r0["flashqla_ms"], r0["flash_qla_ms"], r0["fla_ms"]) == (1.0, 1.3, 2.0)
    assert r0["fla_over_flashqla"] == 2.0 and abs(r0["flash_qla_over_flashqla"] - 1.3) < 1e-12
    assert r0["peak_extra_mib"]["fla"] == 123.0 and r0["fla_first_call_s"] == 3.0
    assert r1["fla_ms"] is None and "fla" in r1["errors"]          # not measured: said so
    assert results["versions"]["fla"] == "0.6.0" and results["fla_process"]["dispatch_disabled"]


def test_dry_run_json_has_every_column(dry):
    res, _, _, _ = dry
    for key in ("gpu", "driver", "date", "commit", "versions", "rows", "reference_check"):
        assert key in res
    for lib in ("torch", "triton", "fla", "flash_qla", "tilelang", "driver", "flashqla"):
        assert lib in res["versions"]
    rows = res["rows"]
    assert [sum(r["pass"] == p for r in rows) for p in ("fwd", "bwd", "train", "decode", "verify")] == \
        [15, 5, 5, 10, 3]
    for r in rows:
        assert "flash_qla_ms" in r and "flashqla_ms" in r and "fla_ms" in r
        if r["pass"] in ("fwd", "train"):
            assert set(r["peak_extra_mib"]) == {"flashqla", "flash_qla", "fla"}
        else:
            assert "peak_extra_mib" not in r
        if r["pass"] in ("decode", "verify") or r.get("gates") == "fused":
            assert r["flash_qla_ms"] is None             # FlashQLA has no decode, no fused gates
    measured = [r for r in rows[:20] if r["pass"] not in ("decode", "verify") and not r.get("gates")]
    assert all(r["flash_qla_ms"] is not None and r.get("flash_qla_jit_s") is not None for r in measured)
    assert any(r["flash_qla_over_flashqla"] is not None for r in measured)
    for r in rows[20:]:                                     # skipped by the (fake) time budget
        assert r["errors"].get("skipped") == "time budget" and r["flashqla_ms"] is None


def test_dry_run_fla_came_from_its_own_process(dry):
    res, _, _, _ = dry
    proc = res["fla_process"]
    assert proc["returncode"] == 0 and proc["dispatch_disabled"] is True
    assert proc["env"]["FLA_DISABLE_BACKEND_DISPATCH"] == "1"
    assert all(r["fla_ms"] is not None for r in res["rows"])
    assert res["reference_check"]["cases"]["anchor"]["fla_ok"] is True     # merged from the child
    assert "flash_qla" in res["reference_check"]["cases"]["anchor"]


def test_dry_run_prints_the_final_table_last(dry, tmp_path):
    _, stdout, table, path = dry
    lines = [x for x in stdout.splitlines() if x.strip()]
    tlines = [x for x in table.splitlines() if x.strip()]
    assert tlines and lines[-len(tlines):] == tlines
    assert "FlashQLA" in tlines[0] and "FQLA/fq" in tlines[1] and "FLA/fq" in tlines[1]
    assert "FlashQLA first calls in total" in stdout      # JIT times, apart from the timings
    # --from-json re-prints the same final table last
    again = run_bench(["--from-json", path, "--table-file", str(tmp_path / "t2.txt")], tmp_path)
    assert [x for x in again.splitlines() if x.strip()][-len(tlines):] == tlines
