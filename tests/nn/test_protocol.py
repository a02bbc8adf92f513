"""The attention-module protocol (qkv.nn.protocol.AttentionModule): every attention class of qkv.nn, found by
scanning the package, satisfies it; the tools that look for "the attention modules of a model" (capture, head
gates, packed documents, context parallelism, to_gqa) find them through it and refuse modules without an
operator hook instead of skipping them; head gates on the linear modules scale exactly one head."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest
import torch
from torch import nn

import qkv
import qkv.nn
from qkv.nn import (
    DecoderConfig,
    DecoderLM,
    GatedDeltaNet,
    KimiDeltaAttention,
    LatentAttention,
    LatentConfig,
    LinearAttention,
    Mamba2Mixer,
    MultiHeadAttention,
    PerformerAttention,
    SparseLatentAttention,
    TransformerConfig,
    TransformerDecoder,
    get_config,
)
from qkv.nn.protocol import AttentionModule, apply_head_gate, attention_modules

_LATENT = LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8)

# One way to build each attention class of qkv.nn. A class the scan finds without an entry here fails
# test_every_attention_class_is_listed: add its builder, and it is checked like the others.
BUILDERS = {
    "MultiHeadAttention": lambda: MultiHeadAttention(32, 4, n_kv_heads=2, causal=True, layer_idx=3),
    "SelfAttention": lambda: DecoderLM(get_config("tiny-llama")).layers[1].self_attn,
    "LatentAttention": lambda: LatentAttention(_LATENT, layer_idx=2),
    "SparseLatentAttention": lambda: SparseLatentAttention(
        LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=8,
                     qk_rope_head_dim=4, v_head_dim=8), index_n_heads=2, index_head_dim=8, index_topk=4, layer_idx=2),
    "LinearAttention": lambda: LinearAttention(32, 4, causal=True, layer_idx=1),
    "PerformerAttention": lambda: PerformerAttention(32, 4, causal=True, seed=0, layer_idx=1),
    "KimiDeltaAttention": lambda: KimiDeltaAttention(32, num_heads=2, head_dim=8, layer_idx=1),
    "GatedDeltaNet": lambda: GatedDeltaNet(32, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, layer_idx=2),
    "Mamba2Mixer": lambda: Mamba2Mixer(32, num_heads=4, head_dim=8, state_size=4, n_groups=2, layer_idx=3),
    "CompressedAttention": lambda: _deepseek_v4_layer(),
    "IndexedAttention": lambda: _qsa_layer(),
    "BlockSparseAttention": lambda: _msa_layer(),
    "SelectingAttention": lambda: _selecting_layer(),
}


def _msa_layer():
    from qkv.config.msa import MSAConfig

    c = DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48, msa=MSAConfig(index_n_heads=2, index_head_dim=8,
                                                                      block=2, topk_blocks=2, local_blocks=1,
                                                                      layers=(1,)))
    return DecoderLM(c).layers[1].self_attn  # with the model's RoPE table, which its indexer rotates by


def _qsa_layer():
    from qkv.config.qsa import QSAConfig
    from qkv.nn.qsa import IndexedAttention

    c = DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48, qsa=QSAConfig(index_n_heads=2, index_head_dim=8, budget=4,
                                                                      block=2))
    return IndexedAttention.for_decoder(c, 1, None)


def _deepseek_v4_layer():
    from qkv.config.compressed import CompressedAttentionConfig
    from qkv.nn.compressed_attention import CompressedAttention

    cc = CompressedAttentionConfig(attention_types=("sliding", "csa"), q_lora_rank=8, o_groups=2, o_lora_rank=8,
                                   qk_rope_head_dim=4, index_n_heads=2, index_head_dim=8, index_topk=2,
                                   compress_rates={"csa": 2})
    c = DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=8, intermediate_size=48, sliding_window=4, layer_types=("sliding_attention",) * 2,
                      attention_sinks=True, position="none", compressed=cc)
    return CompressedAttention(c, 1)


def _selecting_layer():
    """The base of MSA and QSA (its selection left to them) on a plain GQA config."""
    from qkv.nn.selecting import SelectingAttention

    model = DecoderLM(get_config("tiny-llama"))
    return SelectingAttention(model.config, 1, model.layers[1].self_attn.rope)


def _attention_classes() -> dict[str, type]:
    """Every nn.Module subclass defined in a module of qkv.nn whose name says it is attention, or which carries
    an ``attention_fn`` (so a new attention class cannot hide behind a name)."""
    found = {}
    for info in pkgutil.iter_modules(qkv.nn.__path__, "qkv.nn."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if not (inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__):
                continue
            if "Attention" in name or "attention_fn" in inspect.getsource(obj):
                found[name] = obj
    return found


def test_every_attention_class_is_listed():
    found = _attention_classes()
    assert {"MultiHeadAttention", "SelfAttention", "LatentAttention", "LinearAttention",
            "PerformerAttention"} <= set(found), f"the scan must find the known attention classes, found {found}"
    missing = sorted(set(found) - set(BUILDERS))
    assert not missing, (f"attention classes of qkv.nn without a builder in this test: {missing}; add one to "
                         "BUILDERS so the protocol is checked for them")


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_attention_class_satisfies_the_protocol(name):
    m = BUILDERS[name]()
    assert type(m).__name__ == name
    assert isinstance(m, AttentionModule), f"{name} does not follow qkv.nn.protocol.AttentionModule"
    for attr in ("n_heads", "n_kv_heads", "layer_idx"):
        value = getattr(m, attr)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, (name, attr, value)
    assert m.n_heads >= 1 and m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads == 0, (m.n_heads, m.n_kv_heads)
    assert m.head_gate is None
    assert m.attention_fn is None or callable(m.attention_fn)
    assert attention_modules(m)[0] == ("", m)


def test_protocol_values_say_what_each_module_is():
    assert BUILDERS["MultiHeadAttention"]().attention_fn is qkv.attention
    mha = BUILDERS["MultiHeadAttention"]()
    assert (mha.n_heads, mha.n_kv_heads, mha.layer_idx) == (4, 2, 3)
    sa = BUILDERS["SelfAttention"]()
    assert (sa.n_heads, sa.n_kv_heads, sa.layer_idx) == (4, 2, 1)
    mla = BUILDERS["LatentAttention"]()
    assert (mla.n_heads, mla.n_kv_heads, mla.layer_idx) == (4, 1, 2), "MLA: one latent read by every head"
    for name in ("LinearAttention", "PerformerAttention"):
        m = BUILDERS[name]()
        assert m.attention_fn is None and (m.n_heads, m.n_kv_heads) == (4, 4)
        with pytest.raises(AttributeError):
            m.attention_fn = qkv.attention  # no operator to replace: the hook is declared absent, not writable


def test_subclasses_outside_qkv_nn_satisfy_it():
    from qkv.models.family_bert import PackedSelfAttention

    m = PackedSelfAttention(32, 4, layer_idx=5)
    assert isinstance(m, AttentionModule) and (m.n_heads, m.n_kv_heads, m.layer_idx) == (4, 4, 5)


def test_attention_modules_finds_them_in_forward_order():
    lm = DecoderLM(get_config("tiny-gemma"))
    assert [n for n, _ in attention_modules(lm)] == [f"layers.{i}.self_attn" for i in range(4)]
    mla = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, latent=_LATENT))
    assert [type(m).__name__ for _, m in attention_modules(mla)] == ["LatentAttention"] * 2
    dec = TransformerDecoder(TransformerConfig(d_model=16, n_heads=2, n_layers=2), cross_attention=True)
    names = [n for n, _ in attention_modules(dec)]
    assert len(names) == 4 and names[0].endswith("self_attn") and "cross" in names[1], names
    with pytest.raises(TypeError, match="attention_modules: model must be a torch nn.Module"):
        attention_modules("model")


class _Hybrid(nn.Module):
    """A softmax layer followed by a linear-attention layer (as hybrid models stack them)."""

    def __init__(self):
        super().__init__()
        self.softmax = MultiHeadAttention(32, 4, causal=True, layer_idx=0)
        self.linear = LinearAttention(32, 4, causal=True, layer_idx=1)

    def forward(self, x, positions=None, **_):
        return self.linear(self.softmax(x).out).out


@pytest.mark.parametrize("cls", [LinearAttention, PerformerAttention])
def test_linear_modules_head_gate_scales_exactly_one_head(cls):
    """The output projection is linear in each head's output: y(g) - b = sum_h g_h c_h with c_h = y(e_h) - b."""
    torch.manual_seed(0)
    kw = {"seed": 0} if cls is PerformerAttention else {}
    m = cls(32, 4, causal=True, dtype=torch.float64, **kw).double().eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    g = torch.tensor([0.5, -1.0, 0.0, 2.0])
    bias = m.o_proj.bias
    for run in (lambda: m(x).out, lambda: m.step(x[:, :1], None).out):  # whole sequence, one decode step
        m.head_gate = None
        plain = run()
        m.head_gate = torch.ones(4)
        assert torch.equal(run(), plain), "gates of 1 change nothing"
        contrib = []
        for h in range(4):
            m.head_gate = torch.eye(4, dtype=torch.float64)[h]
            contrib.append(run() - bias)
        m.head_gate = g
        want = sum(g[h].item() * contrib[h] for h in range(4)) + bias
        torch.testing.assert_close(run(), want, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(sum(contrib) + bias, plain, atol=1e-12, rtol=1e-12)
    m.head_gate = None


def test_head_gates_and_counts_cover_the_linear_modules():
    from qkv.interpret import head_counts, head_gates

    model = _Hybrid().eval()
    assert head_counts(model) == [4, 4]
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        plain = model(x)
        gates = torch.ones(2, 4)
        gates[1, 0] = 0.0
        with head_gates(model, gates):
            gated = model(x)
    assert not torch.allclose(gated, plain)
    assert model.linear.head_gate is None, "gates must be restored"


def test_tools_refuse_modules_without_an_operator_hook():
    from qkv.interpret import capture
    from qkv.models import to_gqa
    from qkv.nn import packed_documents

    model = _Hybrid().eval()
    x = torch.randn(1, 6, 32)
    with pytest.raises(TypeError, match=r"LinearAttention.*attention_fn is None"):
        capture(model, x)
    assert capture(model, x, layers=[0])[0].shape == (1, 4, 6, 6), "the softmax layer can still be captured"
    with pytest.raises(TypeError, match=r"linear \(LinearAttention\).*attention_fn is None"):
        packed_documents(model, torch.tensor([0, 3, 6])).__enter__()
    assert model.softmax.attention_fn is qkv.attention, "a refusal leaves every hook as it was"
    with pytest.raises(ValueError, match=r"linear is LinearAttention"):
        to_gqa(model, 2)


def test_context_parallel_refuses_a_hookless_module(tmp_path):
    import torch.distributed as dist

    import qkv.distributed as cp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    started = not dist.is_initialized()
    if started:  # one process, a file rendezvous: no port to collide with
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match=r"linear \(LinearAttention\) computes no softmax attention"):
            cp.context_parallel(_Hybrid())
        assert cp.context_parallel(_Hybrid().softmax).world == 1
    finally:
        if started:
            dist.destroy_process_group()


def test_apply_head_gate_bad_input():
    out = torch.ones(1, 3, 2, 4)
    assert apply_head_gate(out, None) is out
    with pytest.raises(ValueError, match=r"head_gate must be a \(3,\) tensor.*got \(4,\)"):
        apply_head_gate(out, torch.ones(4))
    with pytest.raises(ValueError, match=r"head_gate must be a \(3,\) tensor.*got list"):
        apply_head_gate(out, [1.0, 1.0, 1.0])
    mha = MultiHeadAttention(16, 2)
    mha.head_gate = torch.ones(3)
    with pytest.raises(ValueError, match=r"head_gate must be a \(2,\) tensor"):
        mha(torch.randn(1, 3, 16))


def test_docstring_examples_run():
    import qkv.nn.protocol as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result
