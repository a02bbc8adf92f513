"""`qkv demo` steps that are cheap enough for the suite (the whole demo runs as `make demo`)."""

from qkv.cli import demo


def test_masks_and_kv_table_steps():
    assert demo.step_masks()["masks_drawn"] == 4
    table = demo.step_kv_table()
    # GQA is 8x smaller than the reference texts' MHA teaching example; MLA smaller still.
    assert table["llama-70b-mha"] / table["llama-3-70b"] == 8.0
    assert table["deepseek-v2"] < table["gemma-3-27b"] < table["llama-3-70b"]


def test_operator_step_agrees_with_float64():
    assert demo.step_operator()["max_error"] < 1e-5
