"""Fast CPU matmuls: every projection and the LM head on oneDNN-reordered weights.

A k-row forward must cost about what a one-row forward costs, or lookahead and speculative
decoding (which verify k rows per forward) cannot win. F.linear (MKL) leaves its one-row
routine for k > 1 rows and repacks W on every call; oneDNN on a weight reordered once into
its blocked layout streams it once for all k rows (`python -m engine.bench --forward-cost`).

    model = prepack(load_model(ckpt))   # in place; CUDA, fp64 and fp16 models keep nn.Linear
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.llama import Llama


class PackedLinear(nn.Module):
    """y = x W^T through oneDNN, W reordered once into its blocked layout (CPU, fp32 or bf16).

    Only the reordered copy is kept (the weights' memory is not doubled), so prepack after
    the weights are final; the module has no `weight`.
    """

    def __init__(self, weight: Tensor, min_rows: int = 1):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.min_rows = min_rows
        # the batch-size hint only tunes the blocked layout; one reordering serves every k
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)

    def forward(self, x: Tensor) -> Tensor:
        n = x.numel() // x.shape[-1]                                  # rows, B*T
        if n >= self.min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        # subtle: oneDNN takes a matrix-vector kernel for one row and a matrix-matrix kernel
        # for two or more, and they round differently; the latter gives every row the same
        # bits whatever the row count, so zero rows make one-row steps take it too
        x2 = F.pad(x.reshape(n, -1), (0, 0, 0, self.min_rows - n))   # (min_rows, in)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")
        return y[:n].view(*x.shape[:-1], -1)                          # (..., out)


def prepack(model: Llama, batch_invariant: bool = False) -> Llama:
    """Swap every projection and the LM head for a PackedLinear, in place; a no-op unless
    the model is fp32 or bf16 on a CPU with oneDNN (CUDA and other dtypes keep nn.Linear).

    batch_invariant: run one-row inputs as two rows so that a row's matmul outputs never
    depend on how many rows shared its forward. Off by default: the two-row kernel makes a
    one-row step 9-27% slower here, and attention sums are not row-invariant anyway (a
    verified row sees its keys at other cache slots, so SIMD lanes add them in another order).
    """
    m = 2 if batch_invariant else 1
    w = model.tok_embeddings.weight
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return model
    for block in model.layers:
        for parent in (block.attention, block.feed_forward):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child.bias is None:
                    setattr(parent, name, PackedLinear(child.weight, m))
    if not model.config.tie_embeddings:
        model.packed_head = PackedLinear(model.output.weight, m)
        del model.output                 # the packed copy replaces it, as in every layer
    else:  # the embedding table stays for lookups; the head reads its packed copy
        model.packed_head = PackedLinear(w, m)
    return model
