"""dev/cuda/prof_decode.py: a decode step to profile (Nsight Compute on fq_recurrent_kernel).

    python3 dev/cuda/prof_decode.py [N] [layout kv|vk] [T]

N sequences x 32 value heads (16 q/k heads), K = V = 128, bf16 tokens, fp32 pool [N, HV, K, V]
with state_indices = arange(N), as benchmarks/bench_gpu.py's decode rows; 5 calls (profile
with --launch-skip 3 --launch-count 1)."""
import sys

import torch

import flashqla

N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
layout = sys.argv[2] if len(sys.argv) > 2 else "kv"
T = int(sys.argv[3]) if len(sys.argv) > 3 else 1
H, HV, K = 16, 32, 128
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(N, T, H, K, generator=g, device=dev), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(N, T, H, K, generator=g, device=dev), dim=-1).bfloat16()
v = torch.randn(N, T, HV, K, generator=g, device=dev).bfloat16()
gate = -torch.rand(N, T, HV, generator=g, device=dev) * 0.1
beta = torch.rand(N, T, HV, generator=g, device=dev)
pool = torch.randn(N, HV, K, K, generator=g, device=dev)
idx = torch.arange(N, dtype=torch.int32, device=dev)
for _ in range(5):
    o = flashqla.gdn_recurrent(q, k, v, gate, beta, pool, state_indices=idx, scale=K ** -0.5, state_layout=layout)
torch.cuda.synchronize()
print("prof_decode: done", tuple(o.shape), layout)
