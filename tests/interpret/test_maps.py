"""Attention rollout (a hand-computed 3-token case), flow (against a brute-force max-flow), its size limit,
head importance, pattern scores, contact maps on a planted-contact case, and the PNG plots."""

import pytest
import torch

from qkv.interpret import (
    apc,
    attention_flow,
    attention_rollout,
    contact_features,
    entropy_score,
    first_token_score,
    fit_contact_regression,
    head_importance,
    induction_score,
    plot_attention,
    plot_layer_grid,
    plot_pruning_curve,
    plot_rollout,
    precision_at,
    previous_token_score,
    symmetrize,
)


def _maps(L=3, B=2, H=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(B, H, N, N, generator=g), -1) for _ in range(L)]


def test_rollout_is_product_of_residual_averaged_maps():
    maps = _maps()
    eye = torch.eye(5, dtype=torch.float64)
    expected = None
    for a in maps:
        m = 0.5 * a.double().mean(1) + 0.5 * eye
        m = m / m.sum(-1, keepdim=True)
        expected = m if expected is None else m @ expected
    out = attention_rollout(maps)
    assert torch.allclose(out.double(), expected, atol=1e-6)
    assert torch.allclose(out.sum(-1), torch.ones(2, 5), atol=1e-5)


def test_rollout_of_identity_attention_is_identity():
    eye = torch.eye(4).expand(1, 3, 4, 4)
    assert torch.allclose(attention_rollout([eye, eye]), torch.eye(4).unsqueeze(0))


def test_flow_single_layer_equals_capacity_and_is_bounded_by_rollout_mass():
    pytest.importorskip("scipy")
    maps = _maps(L=1, B=1, N=4)
    flow = attention_flow(maps, resolution=10**6)
    direct = 0.5 * maps[0].double().mean(1) + 0.5 * torch.eye(4)
    direct = direct / direct.sum(-1, keepdim=True)
    # With one layer the only path from output i to input j is the edge itself.
    assert torch.allclose(flow.double(), direct, atol=1e-5)
    two = attention_flow(_maps(L=2, B=1, N=4))
    assert (two >= 0).all() and (two <= 1 + 1e-6).all()


def test_head_importance_finds_the_useless_head():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w = torch.randn(2, 3, 8, 8)
    w[1, 2] = 0  # layer 1, head 2 contributes nothing

    def loss_fn(gates, i):
        h = x
        for l in range(2):
            heads = torch.stack([h @ w[l, j] for j in range(3)])  # (H, N, D)
            h = h + (gates[l].view(3, 1, 1) * heads).sum(0)
        return h.pow(2).mean()

    scores = head_importance(loss_fn, 2, 3)
    assert scores.shape == (2, 3) and scores[1, 2] == 0 and (scores[0] > 0).all()
    assert torch.allclose(scores.norm(dim=-1), torch.ones(2))


def test_plot_attention_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    p = plot_attention(torch.softmax(torch.randn(3, 4), -1), tmp_path / "a.png", tokens_q=list("abc"),
                       tokens_k=list("wxyz"), title="t")
    assert p.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="one \\(Nq, Nk\\) map"):
        plot_attention(torch.ones(1, 2, 2), tmp_path / "b.png")


def test_rollout_hand_computed_three_tokens():
    # One head per layer. Layer 1: A1; with the residual 0.5 A + 0.5 I, rows already sum to 1.
    a1 = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.4, 0.4]])
    a2 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # By hand: R1 = 0.5 A1 + 0.5 I = [[1,0,0],[.25,.75,0],[.1,.2,.7]]; R2 = I, so rollout = R2 @ R1 = R1.
    want = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.1, 0.2, 0.7]])
    got = attention_rollout([a1.view(1, 1, 3, 3), a2.view(1, 1, 3, 3)])
    assert torch.allclose(got[0], want, atol=1e-7), got
    # Swap the order (A1 on top of a uniform layer): R = R1 @ U with U = 0.5 * 1/3 + 0.5 I.
    u = torch.full((3, 3), 1 / 3)
    ru = 0.5 * u + 0.5 * torch.eye(3)
    got = attention_rollout([u.view(1, 1, 3, 3), a1.view(1, 1, 3, 3)])
    assert torch.allclose(got[0], want @ ru, atol=1e-6)
    # max / min over heads of two heads [A1, I].
    two = torch.stack([a1, torch.eye(3)]).unsqueeze(0)
    mx = attention_rollout([two], head_fusion="max", residual=False)[0]
    assert torch.allclose(mx, torch.maximum(a1, torch.eye(3)) / torch.maximum(a1, torch.eye(3)).sum(-1, keepdim=True))
    mn = attention_rollout([two], head_fusion="min", residual=False)[0]
    assert torch.allclose(mn[0], torch.tensor([1.0, 0, 0])) and torch.allclose(mn[1], torch.tensor([0.0, 1.0, 0]))
    with pytest.raises(ValueError, match="head_fusion must be"):
        attention_rollout([two], head_fusion="median")


def _brute_max_flow(cap, s, t):
    """Edmonds-Karp on a dense capacity matrix (the test's own, independent of SciPy)."""
    import collections

    n = len(cap)
    flow = [[0.0] * n for _ in range(n)]
    total = 0.0
    while True:
        parent = [-1] * n
        parent[s] = s
        dq = collections.deque([s])
        while dq and parent[t] == -1:
            u = dq.popleft()
            for v in range(n):
                if parent[v] == -1 and cap[u][v] - flow[u][v] > 1e-12:
                    parent[v] = u
                    dq.append(v)
        if parent[t] == -1:
            return total
        v, push = t, float("inf")
        while v != s:
            push = min(push, cap[parent[v]][v] - flow[parent[v]][v])
            v = parent[v]
        v = t
        while v != s:
            flow[parent[v]][v] += push
            flow[v][parent[v]] -= push
            v = parent[v]
        total += push


def test_flow_equals_brute_force_max_flow():
    pytest.importorskip("scipy")
    maps = _maps(L=2, B=1, H=2, N=3, seed=3)
    got = attention_flow(maps, resolution=10**6)
    fused = []
    for a in maps:
        m = 0.5 * a[0].double().mean(0) + 0.5 * torch.eye(3, dtype=torch.float64)
        fused.append(m / m.sum(-1, keepdim=True))
    N, L = 3, 2
    cap = [[0.0] * ((L + 1) * N) for _ in range((L + 1) * N)]
    for l, m in enumerate(fused):
        for i in range(N):
            for j in range(N):
                cap[(l + 1) * N + i][l * N + j] = float(m[i, j])
    for i in range(N):
        for j in range(N):
            want = _brute_max_flow(cap, L * N + i, j)
            assert abs(float(got[0, i, j]) - want) < 1e-5, (i, j, float(got[0, i, j]), want)
    cls = attention_flow(maps, rows=[0])
    assert cls.shape == (1, 1, 3) and torch.allclose(cls[0, 0], got[0, 0])


def test_flow_refuses_big_inputs_with_the_cost():
    maps = [torch.softmax(torch.randn(1, 1, 300, 300), -1)] * 6
    with pytest.raises(ValueError, match=r"90,000 max-flow problems over a graph of 540,000 edges, cost 4.86e\+10"):
        attention_flow(maps)
    with pytest.raises(ValueError, match="same"):
        attention_flow([torch.ones(1, 1, 3, 3) / 3, torch.ones(1, 1, 4, 4) / 4])


def test_pattern_scores_on_known_maps():
    n = 6
    prev = torch.zeros(n, n)
    prev[0, 0] = 1
    prev[torch.arange(1, n), torch.arange(n - 1)] = 1
    sink = torch.zeros(n, n)
    sink[:, 0] = 1
    uniform = torch.tril(torch.ones(n, n))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    maps = [torch.stack([prev, sink, uniform]).unsqueeze(0)]
    want = torch.tensor([1.0, 0.2, float(uniform.diagonal(-1).sum() / (n - 1))])  # mean over rows 1 .. n-1
    assert torch.allclose(previous_token_score(maps)[0], want)
    assert torch.allclose(first_token_score(maps)[0, :2], torch.tensor([2 / n, 1.0]))  # rows 0 and 1 see key 0
    ent = entropy_score(maps)[0]
    assert ent[0] == 0 and ent[1] == 0 and torch.isclose(ent[2], torch.log(torch.arange(1, n + 1.0)).mean())
    # Induction: period 3 over 6 tokens; a head that looks at i - 2 (the token after the earlier copy).
    ind = torch.zeros(n, n)
    ind[torch.arange(n), (torch.arange(n) - 2).clamp_min(0)] = 1
    assert induction_score([ind.view(1, 1, n, n)], 3)[0, 0] == 1.0
    assert induction_score([prev.view(1, 1, n, n)], 3)[0, 0] == 0.0
    half = ind.clone()
    half[3] = 0  # row 3 (the first of the second copy) stops attending to key 1
    assert torch.isclose(induction_score([half.view(1, 1, n, n)], 3)[0, 0], torch.tensor(2 / 3))
    valid = torch.tensor([[False, True, True, True, True, True]])
    assert torch.isclose(first_token_score(maps, valid=valid)[0, 0], torch.tensor(1 / (n - 1)))
    with pytest.raises(ValueError, match="period must be"):
        induction_score(maps, 6)
    with pytest.raises(ValueError, match="maps must be"):
        entropy_score([torch.ones(2, 3)])


def test_contacts_planted_case():
    """Heads 1 and 3 of 4 attend to a residue's contact partners; the rest is noise. The regression must find
    them (precision at L/5 near 1 on held-out sequences), far above a single raw map's."""
    g = torch.Generator().manual_seed(0)
    B, N, H = 6, 40, 4
    contacts = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for _ in range(N // 2):
            i, j = sorted(torch.randint(0, N, (2,), generator=g).tolist())
            if j - i >= 6:
                contacts[b, i, j] = contacts[b, j, i] = True
    logits = torch.randn(B, H, N, N, generator=g)
    logits[:, 1] += 3.0 * contacts
    logits[:, 3] += 2.0 * contacts
    logits[:, 2] += 4.0 * (torch.arange(N).view(-1, 1) - torch.arange(N).view(1, -1)).abs().lt(2)  # local head
    maps = [torch.softmax(logits, -1), torch.softmax(torch.randn(B, H, N, N, generator=g), -1)]
    feats = contact_features(maps)
    assert feats.shape == (B, 2 * H, N, N) and torch.allclose(feats, feats.transpose(-1, -2), atol=1e-6)
    model = fit_contact_regression(feats[:4], contacts[:4], steps=40)
    pred = model.predict(feats[4:])
    p_fit = precision_at(pred, contacts[4:], top=N // 5)
    p_noise = precision_at(symmetrize(maps[1][4:, 0]), contacts[4:], top=N // 5)
    p_local = precision_at(symmetrize(maps[0][4:, 2]), contacts[4:], top=N // 5)
    assert p_fit > 0.9 and p_noise < 0.3 and p_local < 0.3, (p_fit, p_noise, p_local)
    assert model.weight[1].abs() > model.weight[5].abs(), model.weight
    # APC removes the rank-one background: a map that is an outer product becomes zero.
    r = torch.rand(7, 1)
    assert apc(r @ r.T).abs().max() < 1e-6
    with pytest.raises(ValueError, match="both contacts and non-contacts"):
        fit_contact_regression(feats[:1], torch.zeros(1, N, N))
    with pytest.raises(ValueError, match="square"):
        symmetrize(torch.ones(2, 3))


def test_more_plots(tmp_path):
    pytest.importorskip("matplotlib")
    toks = list("abcd")
    grid = plot_layer_grid(torch.softmax(torch.randn(5, 4, 4), -1), tmp_path / "g.png", tokens=toks, title="L0")
    roll = plot_rollout(attention_rollout(_maps(N=4))[0], tmp_path / "r.png", tokens=toks)
    curve = plot_pruning_curve([0, 2, 4], [1.0, 0.9, 0.5], tmp_path / "c.png")
    big = plot_attention(torch.softmax(torch.randn(300, 300), -1), tmp_path / "big.png", tokens_q=["t"] * 300,
                         tokens_k=["t"] * 300)
    for p in (grid, roll, curve, big):
        assert p.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="tokens must be a sequence of 4"):
        plot_layer_grid(torch.ones(2, 4, 4), tmp_path / "x.png", tokens=["a"])
    with pytest.raises(ValueError, match="one layer's maps"):
        plot_layer_grid(torch.ones(1, 2, 4, 4), tmp_path / "x.png")
    with pytest.raises(ValueError, match="one \\(N, N\\) map"):
        plot_rollout(torch.ones(1, 4, 4), tmp_path / "x.png")


def test_html_view_data_and_bad_input(tmp_path):
    import base64
    import json

    from qkv.interpret import attention_html, view_data

    maps = [torch.softmax(torch.randn(2, 3, 3), -1) for _ in range(2)]
    data = view_data(["a", "</script>", "c"], maps, rollout=attention_rollout([m.unsqueeze(0) for m in maps])[0],
                     importance=torch.rand(2, 2))
    raw = base64.b64decode(data["maps"][1][0]["b64"])
    top = float(maps[1][0].max())
    assert data["maps"][1][0]["scale"] == top and max(raw) == 255
    assert list(raw) == (maps[1][0] * (255 / top)).round().to(torch.uint8).flatten().tolist()
    path = attention_html(tmp_path / "v.html", ["a", "</script>", "c"], maps)
    text = path.read_text()
    payload = text.split('id="qkv-data">')[1].split("</script>")[0]
    assert json.loads(payload)["tokens"][1] == "</script>", "token text must not close the data script"
    assert "http://" not in text and "https://" not in text
    with pytest.raises(ValueError, match=r"must be \(H, N, N\) = \(2, 4, 4\)"):
        view_data(list("abcd"), maps)
    with pytest.raises(ValueError, match="importance must be"):
        view_data(list("abc"), maps, importance=torch.ones(3, 2))
    with pytest.raises(ValueError, match="at least one layer"):
        view_data(list("abc"), [])


def test_html_page_opens_on_the_chosen_layer_and_head_and_refuses_one_out_of_range(tmp_path):
    import json

    from qkv.interpret import attention_html, view_data

    maps = [torch.softmax(torch.randn(2, 3, 3), -1) for _ in range(2)]
    assert view_data(list("abc"), maps)["start"] is None  # the explorer keeps the page's own choice
    text = attention_html(tmp_path / "v.html", list("abc"), maps, layer=1, head=1).read_text()
    payload = json.loads(text.split('id="qkv-data">')[1].split("</script>")[0])
    assert payload["start"] == {"layer": 1, "head": 1}
    for kw, bad in (("layer", 2), ("layer", -1), ("head", 2), ("head", True), ("layer", 1.0)):
        with pytest.raises(ValueError, match=rf"view_data: {kw} must be an int in \[0, 2\) for these maps, got "):
            attention_html(tmp_path / "bad.html", list("abc"), maps, **{kw: bad})
    assert not (tmp_path / "bad.html").exists()


def test_bad_input_gets_a_clear_error_not_a_torch_one():
    """Layers of different sizes, non-tensors, mismatched contact maps and an out-of-range head are refused
    with ValueError/TypeError naming the argument, before any arithmetic (old code: torch RuntimeError,
    AttributeError, IndexError, or nothing until the forward)."""
    from qkv.interpret import patch_heads
    from qkv.nn import DecoderConfig, DecoderLM

    a6, a5 = torch.rand(1, 2, 6, 6), torch.rand(1, 2, 5, 5)
    with pytest.raises(ValueError, match="attention_rollout: every layer must have the same batch and tokens"):
        attention_rollout([a6, a5])
    with pytest.raises(TypeError, match="list of .B, H, N, N. tensors"):
        attention_rollout([a6.tolist()])
    with pytest.raises(ValueError, match="attention_flow: every layer must have the same"):
        attention_flow([a6, a5])
    with pytest.raises(ValueError, match=r"precision_at: pred and contacts must both be \(B, N, N\)"):
        precision_at(torch.rand(1, 8, 8), torch.rand(1, 7, 7))
    with pytest.raises(ValueError, match="precision_at: top must be a positive int"):
        precision_at(torch.rand(1, 8, 8), torch.rand(1, 8, 8), top=0)
    lm = DecoderLM(DecoderConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=16)).eval()
    with pytest.raises(ValueError, match=r"patch_heads: head 2 is out of range for layers.0.self_attn \(2 heads\)"):
        with patch_heads(lm, {(0, 2): torch.zeros(())}):
            pass
    from qkv.interpret import ablate_heads, head_outputs, model_head_importance, pruning_curve, render_page

    with pytest.raises(TypeError, match="head_importance: loss_fn must be callable"):
        head_importance("loss", 2, 4)
    with pytest.raises(ValueError, match="head_importance: batches must be a positive int, got 0"):
        head_importance(lambda g, i: g.sum(), 2, 4, batches=0)
    with pytest.raises(ValueError, match=r"head_importance: loss_fn must return a scalar tensor .* got \(2, 4\)"):
        head_importance(lambda g, i: g * 2, 2, 4)
    with pytest.raises(TypeError, match="model_head_importance: loss_fn must be callable"):
        model_head_importance(lm, lambda m, b: 0, [0])
    with pytest.raises(TypeError, match="pruning_curve: measure.model. must return a number, got str"):
        pruning_curve(lm, torch.rand(1, 2), lambda m: "high", [0])
    ids = torch.randint(0, 20, (1, 5))
    with pytest.raises(ValueError, match="ablate_heads: reference must be head_outputs.model, ids. for all 1"):
        with ablate_heads(lm, [(0, 1)], reference=head_outputs(lm, ids) * 2):
            pass
    with pytest.raises(TypeError, match=r"ablate_heads: heads must be \(module index, head\) pairs, got 1"):
        with ablate_heads(lm, [1]):
            pass
    with pytest.raises(TypeError, match="render_page: data must be view_data"):
        render_page("data")
