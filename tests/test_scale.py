"""tools/scale.py: bigger shapes' step time and k-row cost, from random weights."""
import pytest

from tools import scale


def test_scale_refuses_bad_flags_in_one_line(capsys):
    for argv in (["--repeats", "0"], ["--shapes", "llama-70b"]):
        with pytest.raises(SystemExit) as e:
            scale.main(argv)
        assert e.value.code == 2 and capsys.readouterr().err.startswith("error:")


def test_the_shapes_are_llama_3_2s():
    # Why: the figures claim Llama 3.2 1B and 3B: their parameter counts must be those models'
    from engine.load.weights import parameter_count
    assert round(parameter_count(scale.SHAPES["llama-3.2-1b"]) / 1e9, 2) == 1.24
    assert round(parameter_count(scale.SHAPES["llama-3.2-3b"]) / 1e9, 2) == 3.21


def test_the_table_has_a_row_per_measured_path():
    r = {"ms": {k: 10.0 * k for k in scale.KS}, "ratio": {k: float(k) for k in scale.KS}, "weight_mb": 538,
         "roof_ms": 5.0, "fraction_of_roof": 0.5, "copy_gbps": 16.0}
    table = scale.markdown({"shapes": {"smollm2-135m fp32": r, "smollm2-135m int4": r}})
    lines = table.splitlines()
    assert len(lines) == 4 and "| smollm2-135m | int4 | 538 | 10.0 | 5.0 | 50% | 2.00x |" in lines[3]
