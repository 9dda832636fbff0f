"""Temporary diagnostic (to be removed): bf16-storage SGD step, Triton kernels vs the torch path."""
import torch
from ctrflow.embedding.fused import ops
torch.manual_seed(0)
for dim in (64, 128):
    for pre in (True, False):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            R = 80000
            w0 = (torch.rand(R, dim) - 0.5).to(dtype)
            off = torch.tensor([0, 5000, 5003, 75003])
            n = torch.tensor([5000, 3, 70000, 10], dtype=torch.float64)
            u = torch.rand(4096, 4, dtype=torch.float64)
            ids = torch.minimum(torch.exp(u * torch.log1p(n)).long() - 1, n.long() - 1)
            g = torch.randn(4096, 4, dim)
            st = lambda d: ops.RowState("sgd", torch.tensor([0.5, 0.], device=d), torch.zeros(1, device=d), torch.zeros(1, device=d))
            wc = w0.clone(); ops.update_rows(ids, off, g, wc, st("cpu"), {}, pre)
            wg = w0.cuda(); ops.update_rows(ids.cuda(), off.cuda(), g.cuda(), wg, st("cuda"), {}, pre)
            torch.cuda.synchronize()
            d = (wg.cpu().float() - wc.float()).abs().max(dim=1).values
            bad = d > 0.02 * wc.float().abs().max(dim=1).values + 1e-2
            rows = bad.nonzero().flatten()
            unchanged = int((wg.cpu()[rows] == w0[rows]).all(dim=1).sum()) if len(rows) else 0
            print(f"dim {dim} pre {pre} {dtype}: bad rows {int(bad.sum())} of {int(((wc != w0).any(1)).sum())} touched;"
                  f" unchanged among bad {unchanged}; first {rows[:5].tolist()}", flush=True)
