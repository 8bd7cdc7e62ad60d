"""A linear layer laid out for decoding on a CPU, where one token is a matrix-vector product.

Decoding one token multiplies a vector by every weight matrix of the model once, so it runs at
the speed memory streams weights in. On the 2-core machine this repository was measured on
(AMD EPYC, torch 2.13's MKL), `F.linear` on one row streams SmolLM2's 540 MB of fp32 weights
at about 12 GB/s whether torch has one thread or two, while a plain reduction over as many
bytes reads about 27 GB/s: the product runs on one thread. Two changes reach the bound:

  * the weight stored transposed, (in, out): MKL's kernel for a row times an (in, out) matrix
    streams faster than its kernel for an (out, in) one (17 GB/s);
  * that matrix cut along `in` into `splits` slabs, (splits, in / splits, out): `torch.bmm`
    runs one product per slab and spreads the slabs over the threads, and the partial results
    are summed (31 GB/s at best, with 4 slabs on 2 threads).

The sum adds the slabs' partial products in another order than one product would, so results
differ from `F.linear` by rounding only (about 1e-7 relative in fp32).

Several rows at once (a serving step's decodes, a prompt), and every product in bf16, go to
oneDNN's kernel instead, on a copy of the weight that oneDNN has packed ahead of time into the
tiles its kernel reads (`onednn_weight`; `torch.compile` packs weights the same way under
freezing). Measured here on SmolLM2: a whole forward's products for 16 rows in fp32 took 25 ms
against 49 ms through the slabs; an eager bf16 decode step of one row, 26 ms against 33 ms
through `F.linear`; the serving benchmark's 16 requests ran 1.34-1.38x faster in fp32 and
1.15-1.24x in bf16. One row in fp32 stays with the slabs, which stream faster (a decode step
took 31 ms, against 40 ms through oneDNN). The packed copy costs the weight's size again.
Where oneDNN cannot pack (a torch without it, bf16 on a CPU without bf16 instructions, fp16,
fp64, another device), several rows are one plain product.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def onednn_weight(weight: torch.Tensor):
    """`weight` (out, in) packed for oneDNN's linear kernel, or None where oneDNN cannot serve it:
    a CPU weight in fp32, or bf16 on a CPU with bf16 instructions."""
    supported = weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and (
        weight.dtype == torch.float32 or
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()) if supported \
        else None


class MatVec(nn.Module):
    """`y = x @ weight.T` for a weight (out, in), in the layout that streams fastest."""

    def __init__(self, weight: torch.Tensor, splits: int = 4):
        super().__init__()
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        split = weight.dtype == torch.float32 and weight.device.type == "cpu" and \
            splits > 1 and in_features % splits == 0
        self.splits = splits if split else 1
        if split:     # (splits, in / splits, out): slab j holds rows j*in/splits... of weight.T
            w = weight.detach().t().contiguous().view(splits, in_features // splits, out_features)
        else:
            w = weight.detach().contiguous()                                 # (out, in)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.packed = onednn_weight(weight)       # oneDNN's copy, or None

    def forward(self, x):
        *lead, n = x.shape
        rows = x.reshape(-1, n)                                              # (M, in)
        M, s = rows.shape[0], self.splits
        if torch.compiler.is_compiling():       # a compiler packs the weight its own way
            y = self._one_product(rows)
        elif M == 1 and s > 1:                  # one row in fp32: the slabs, over the threads
            slabs = rows.view(M, s, n // s).transpose(0, 1)                  # (s, M, in/s)
            y = torch.bmm(slabs, self.weight).sum(0)                         # (M, out)
        elif self.packed is not None:           # several rows, or bf16: oneDNN's kernel
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        else:
            y = self._one_product(rows)
        return y.view(*lead, self.out_features)

    def _one_product(self, rows):
        if self.splits == 1:
            return F.linear(rows, self.weight)
        return rows @ self.weight.view(self.in_features, self.out_features)

    def _apply(self, fn, recurse=True):
        """`.to(...)` and the like move or convert the weight: pack the result again."""
        super()._apply(fn, recurse)
        w = self.weight if self.splits == 1 else \
            self.weight.view(self.in_features, self.out_features).t()
        self.packed = onednn_weight(w)
        return self
