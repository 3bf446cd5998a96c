"""tools/kernels.py: the 4-bit path's matmul candidates at k rows."""
import torch

from tools.kernels import ROWS, int8_qlinear


def test_the_int8_candidate_gives_every_row_its_one_row_bits_by_construction():
    # why: the int8 candidate is the one argued exact on any CPU (integer sums are exact in any
    # order, each row quantized by its own scale); broken variant: one scale for the whole call
    # (per-tensor dynamic quantization, the common recipe) makes a row's bits depend on the others
    torch.manual_seed(0)
    w, x = torch.randn(64, 96) * 0.02, torch.randn(max(ROWS), 96)
    x[3] *= 50                                                   # an outlier row
    mm = int8_qlinear(w)
    alone = torch.cat([mm(x[i:i + 1]) for i in range(len(x))])
    assert all(torch.equal(mm(x[:k]), alone[:k]) for k in ROWS)
    rel = (mm(x) - x @ w.t()).norm() / (x @ w.t()).norm()
    assert rel < 0.02                                            # and it is still the matmul

    def shared_scale(x):                                         # the broken variant
        a = x.abs().amax() / 127
        return (torch.round(x / a) @ torch.round(w.t() / (w.abs().amax(1) / 127))) * a * (w.abs().amax(1) / 127)
    alone = torch.cat([shared_scale(x[i:i + 1]) for i in range(len(x))])
    assert not torch.equal(shared_scale(x), alone)


def test_the_dequantized_in_a_graph_candidate_is_the_4bit_paths_own_matmul():
    # why: its time is weighed against torch's 4-bit kernel only if it multiplies by the same
    # weights (codes, scales and mins unpacked as Int4Linear holds them); broken variant: the two
    # nibbles of a byte read in the other order, a plausible packing slip, is another matrix
    from engine.fast.packed import Int4Linear
    from tools.kernels import dequantized
    torch.manual_seed(0)
    w, x = torch.randn(48, 96) * 0.02, torch.randn(5, 96).bfloat16()
    want = Int4Linear(w)(x).float()                              # the path's kernel, bf16 out
    for blocked in (False, True):
        got = dequantized(w, blocked, compile_=False)(x).float()
        assert (got - want).abs().max() <= 0.01 * want.abs().max()


def test_the_one_row_rates_count_the_bytes_the_4bit_kernel_reads():
    # why: the one-row table says the kernel is bound by its arithmetic when its GB/s sits far
    # under the machine's read rate; that holds only if the bytes are what it reads: half a byte
    # a weight, and a bf16 scale and min per 32 (broken variant: the codes alone, 20% short)
    from tools.kernels import LAYER, markdown, one_row
    rows = one_row(2)
    for name, (out, n) in LAYER.items():
        assert rows[name]["bytes"] == out * n // 2 + out * (n // 32) * 2 * 2
        assert all(r["gb_s"] > 0 for k, r in rows[name].items() if k != "bytes")
    table = markdown({"kernels": {}, "one_row": rows, "peak_gmac_s": {}})
    assert all(f"| {name} |" in table for name in LAYER)
