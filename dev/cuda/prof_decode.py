"""dev/cuda/prof_decode.py: a decode step to profile (Nsight Compute on fq_recurrent_kernel).

    python3 dev/cuda/prof_decode.py [N] [layout kv|vk] [T] [fla]

The inputs of benchmarks/bench_gpu.py's decode rows (its make_decode_inputs: 16/32 heads,
K = V = 128, bf16 tokens, the anchor gates, an fp32 pool with state_indices = arange(N)) and
its call; 5 calls (profile with --launch-skip 3 --launch-count 1). With `fla` last: FLA 0.6.0's
fused_recurrent_gated_delta_rule on the same inputs (the states themselves, no indices; [K, V]
only), for its kernel's side-by-side profile."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import bench_gpu as bg  # noqa: E402

import flashqla  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
layout = sys.argv[2] if len(sys.argv) > 2 else "kv"
T = int(sys.argv[3]) if len(sys.argv) > 3 else 1
t = bg.make_decode_inputs(16, 32, N, T, torch.Generator(device="cuda").manual_seed(0), layout=layout)
if len(sys.argv) > 4 and sys.argv[4] == "fla":
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    for _ in range(5):
        o, _ = fused_recurrent_gated_delta_rule(t.q, t.k, t.v, t.g, t.beta, scale=t.scale, initial_state=t.state,
                                                output_final_state=True)
else:
    for _ in range(5):
        o = flashqla.gdn_recurrent(t.q, t.k, t.v, t.g, t.beta, t.state, state_indices=t.indices, scale=t.scale,
                                   state_layout=layout)
torch.cuda.synchronize()
print("prof_decode: done", tuple(o.shape), layout)
