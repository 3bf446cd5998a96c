"""engine/fast/prepared.py: the 4-bit model kept on disk, read back instead of quantized."""
import os
import shutil

import pytest
import torch

from engine.fast.packed import quantize_int4
from engine.fast import prepared
from engine.fast.prepared import int4_model
from engine.load.weights import load_model


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """test_hostile's tiny converted checkpoint (2 layers, shapes that pack in 4-bit groups)."""
    import tools.convert
    from test_hostile import write_gguf
    d = tmp_path_factory.mktemp("tiny")
    return tools.convert.convert(write_gguf(d / "tiny.gguf"), d / "ckpt")


def same_model(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    tokens = torch.tensor([[1, 5, 9, 2]])
    return (sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
            and torch.equal(a(tokens, torch.arange(4)), b(tokens, torch.arange(4))))


def test_the_kept_model_is_the_quantized_one_bit_for_bit(tiny_checkpoint, tmp_path):
    # why: a run that reads the kept file must decode exactly as one that quantizes; a tensor
    # left out of the file, or one saved before quantize_int4's last step (its bf16 cast), would
    # load into a model that answers otherwise
    notes = []
    first = int4_model(tiny_checkpoint, notes.append, tmp_path)
    kept = list(tmp_path.glob("int4-*.safetensors"))
    second = int4_model(tiny_checkpoint, notes.append, tmp_path)
    assert len(kept) == 1 and not notes
    reference = quantize_int4(load_model(tiny_checkpoint))
    assert same_model(first, reference) and same_model(second, reference)
    assert second.layers[0].attention.wqkv.packed.data_ptr() != first.layers[0].attention.wqkv.packed.data_ptr()


def broken(path, kind: str, other=None) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "foreign":   # the same bytes but another key: written by another version or machine
        path.write_bytes(data.replace(prepared.VERSION.encode(), b"prepared 0"))
    elif kind == "wrong model":
        shutil.copyfile(other, path)


@pytest.mark.parametrize("kind", ["truncated", "empty", "foreign", "wrong model"])
def test_a_bad_kept_file_is_one_notice_and_prepared_anew_then_read(tiny_checkpoint, tmp_path, kind):
    # why: a file cut short (a disk that filled), empty, of another version, or another model's
    # (copied by hand) must never load as this model: one notice, a new file, and the run after
    # reads it quietly. Broken variant run: read() without the key check loads the wrong
    # model's and the foreign file silently (this test fails for both)
    other_ckpt = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other_ckpt)
    os.utime(other_ckpt / "config.json", ns=(1, 1))         # the same weights, another checkpoint's key
    other_dir = tmp_path / "other-cache"
    int4_model(other_ckpt, print, other_dir)
    folder = tmp_path / "cache"
    int4_model(tiny_checkpoint, print, folder)
    (path,) = folder.glob("int4-*.safetensors")
    broken(path, kind, other=next(other_dir.glob("int4-*.safetensors")))
    notes = []
    model = int4_model(tiny_checkpoint, notes.append, folder)
    assert len(notes) == 1 and notes[0].endswith("preparing the 4-bit weights anew"), notes
    assert same_model(model, quantize_int4(load_model(tiny_checkpoint)))
    again = []
    int4_model(tiny_checkpoint, again.append, folder)
    assert not again and len(list(folder.glob("int4-*.safetensors"))) == 1


def test_a_checkpoint_changed_on_disk_is_prepared_anew(tiny_checkpoint, tmp_path):
    # why: a checkpoint converted again (new weights, same folder) must not be answered from the
    # old kept file; the key holds each file's size and modification time
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    folder = tmp_path / "cache"
    int4_model(ckpt, print, folder)
    os.utime(next(ckpt.glob("*.safetensors")), ns=(2, 2))
    int4_model(ckpt, print, folder)
    assert len(list(folder.glob("int4-*.safetensors"))) == 2
