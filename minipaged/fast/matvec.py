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
differ from `F.linear` by rounding only (about 1e-7 relative in fp32). Many rows at once (a
prompt) are one plain product with the same (in, out) matrix. bf16 and other devices keep
`F.linear` on the (out, in) weight: torch's bf16 products take another path, which splitting
does not speed up (`torch.compile` with freezing packs bf16 weights for oneDNN instead).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SPLIT_ROWS = 16      # up to this many rows per product, split the matrix; more: one product


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

    def forward(self, x):
        if self.splits == 1:
            return F.linear(x, self.weight)
        *lead, n = x.shape
        rows = x.reshape(-1, n)                                              # (M, in)
        M, s = rows.shape[0], self.splits
        if M > SPLIT_ROWS or torch.compiler.is_compiling():  # a compiler makes its own kernel
            y = rows @ self.weight.view(n, self.out_features)               # (M, out)
        else:
            slabs = rows.view(M, s, n // s).transpose(0, 1)                  # (s, M, in/s)
            y = torch.bmm(slabs, self.weight).sum(0)                         # (M, out)
        return y.view(*lead, self.out_features)
