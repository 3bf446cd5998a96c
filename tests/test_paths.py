"""engine/fast/paths.py: the path a run takes when its flags leave it open, and the name the
stats line gives it. The default must be fast and exact: 4 bits on a CPU where the model packs
and the kernels have SIMD, else fp32 with batch-invariant kernels; never a near-exact path."""
import pytest

from engine.fast import paths
from engine.fast.paths import RunPath, default_path, packs_int4
from engine.llama import LlamaConfig

PACKS = LlamaConfig(dim=576, n_layers=2, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=64)   # SmolLM2's
ODD = LlamaConfig(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=40, vocab_size=64)        # 48 % 32 != 0


def test_a_run_with_no_path_flags_takes_the_4_bit_path_where_the_model_packs(monkeypatch):
    monkeypatch.setattr(paths, "ATEN_CAPABILITY", "AVX2")
    assert default_path(PACKS) == RunPath("bfloat16", True, None)
    assert default_path(PACKS).name == "int4 bf16"


@pytest.mark.parametrize("config,device,dispatch,why", [
    (ODD, "cpu", "AVX2", "do not pack"), (PACKS, "cuda", "AVX2", "on cuda"), (PACKS, "cpu", "DEFAULT", "SIMD")])
def test_where_4_bits_cannot_serve_the_default_is_fp32_made_exact(monkeypatch, config, device, dispatch, why):
    # Why: the default keeps the promise everywhere; fp32 is only near-exact without the
    # batch-invariant kernels, so the fallback turns them on, and says why it fell back
    monkeypatch.setattr(paths, "ATEN_CAPABILITY", dispatch)
    p = default_path(config, device)
    assert (p.dtype, p.int4, p.batch_invariant) == ("float32", False, True) and why in p.why
    assert p.name == "fp32 batch-invariant"
    # --no-prepack has no batch-invariant kernels to turn on: fp32, near-exact, as asked
    assert default_path(config, device, packed=False).batch_invariant is False


def test_a_flag_given_is_the_path_asked_for():
    assert default_path(PACKS, dtype="float32") == RunPath("float32", False, None)     # HF's tokens
    assert default_path(PACKS, int4=True) == RunPath("bfloat16", True, None)            # --int4 alone
    assert default_path(PACKS, dtype="bfloat16") == RunPath("bfloat16", False, None)
    assert default_path(PACKS, int4=False) == RunPath("float32", False, None)           # --no-int4
    assert default_path(PACKS, dtype="float32", batch_invariant=True).name == "fp32 batch-invariant"


def test_packing_is_judged_on_every_projection():
    assert packs_int4(PACKS) and not packs_int4(ODD)
    # the broken variant: a check of the model width alone passes a model whose FFN does not pack
    ffn = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=40, vocab_size=64)
    assert ffn.dim % 32 == 0 and not packs_int4(ffn)
