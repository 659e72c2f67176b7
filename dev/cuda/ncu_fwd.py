"""Forward calls for Nsight Compute (dev tool, GPU machine):

    ncu --clock-control none -k regex:fq_fwd_ --launch-skip 3 --launch-count 3 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python dev/cuda/ncu_fwd.py 16 32 8192

runs flashqla.gdn_chunk_fwd on bench-like inputs (bf16 q, k, v, L2-normalised
q, k, fp32 gates, h0, final state) three times: the first call's stages A, B,
C are skipped by --launch-skip 3, the second call's are profiled.
"""
import sys

import torch
import torch.nn.functional as F

import flashqla

H, HV, T = (int(x) for x in sys.argv[1:4]) if len(sys.argv) >= 4 else (16, 32, 8192)
K = V = 128
gen = torch.Generator(device="cuda").manual_seed(0)
dev = "cuda"


def l2n(x):
    return (x / x.norm(dim=-1, keepdim=True)).to(torch.bfloat16)


q = l2n(torch.randn(1, T, H, K, generator=gen, device=dev))
k = l2n(torch.randn(1, T, H, K, generator=gen, device=dev))
v = torch.randn(1, T, HV, V, generator=gen, device=dev).to(torch.bfloat16)
g = (-F.softplus(torch.randn(1, T, HV, generator=gen, device=dev))).contiguous()
beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen, device=dev)).contiguous()
h0 = torch.randn(1, HV, K, V, generator=gen, device=dev)
for _ in range(3):
    o, ht, ctx = flashqla.gdn_chunk_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True)
torch.cuda.synchronize()
print("ok", tuple(o.shape), float(o.float().abs().mean()))
