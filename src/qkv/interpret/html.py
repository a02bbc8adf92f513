"""A self-contained HTML view of attention: head view, model view (every layer and head), rollout and head
importance, in one file that works opened from disk (no CDN, no network: the script, the style and the
data are inline).

Maps are drawn on ``<canvas>`` elements from byte arrays (one pixel per (query, key) cell, scaled up for
short inputs), never one DOM node per cell, so the page stays responsive at thousands of tokens. The head and
rollout maps carry their token labels on two more canvases: query tokens down the left (rows), key tokens
across the top (columns), every token when the rows are tall enough for text, else every k-th with its index.
Each map is stored as bytes ``round(255 * p / max(p))`` in base64 with its ``max(p)`` (so the diffuse maps of
long inputs keep their shape): a page holds ``layers * heads * N^2`` bytes of maps (choose layers and heads
when capturing long inputs). The same renderer serves ``qkv explore``.

Shape legend: L layers, H heads, N tokens.
"""

from __future__ import annotations

import base64
import html as _html
import json
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["view_data", "render_page", "attention_html", "quantize"]


def quantize(a: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(round(255 * a / max(a)) as uint8, max(a))`` for a map of probabilities (all zeros: scale 0)."""
    a = a.detach().float().clamp_min(0).cpu()
    top = float(a.max()) if a.numel() else 0.0
    q = (a * (255.0 / top)).round() if top > 0 else torch.zeros_like(a)
    return q.to(torch.uint8).contiguous(), top


def _bytes(a: torch.Tensor) -> dict:
    q, top = quantize(a)
    return {"b64": base64.b64encode(q.numpy().tobytes()).decode("ascii"), "scale": top}


def view_data(tokens: Sequence[str], maps: Sequence[torch.Tensor], *, rollout: torch.Tensor | None = None,
              importance: torch.Tensor | None = None, layer_names: Sequence[str] | None = None,
              head_names: Sequence[str] | None = None, layer: int | None = None, head: int | None = None) -> dict:
    """The page's data: ``tokens`` (N strings); ``maps`` one (H, N, N) per layer (batch row already chosen);
    ``rollout`` (N, N); ``importance`` (L, H); ``layer`` and ``head``: the head the page opens on (default:
    the page keeps its current choice, layer 0 and head 0 at first)."""
    n = len(tokens)
    if not maps:
        raise ValueError("view_data: need at least one layer of maps")
    H = maps[0].shape[0]
    for a in maps:
        if not isinstance(a, torch.Tensor) or a.dim() != 3 or tuple(a.shape) != (H, n, n):
            raise ValueError(f"view_data: each layer's maps must be (H, N, N) = ({H}, {n}, {n}) for {n} tokens, got "
                             f"{tuple(getattr(a, 'shape', ()))}; pick the batch row of a captured (B, H, N, N) map")
    if rollout is not None and tuple(rollout.shape) != (n, n):
        raise ValueError(f"view_data: rollout must be (N, N) = ({n}, {n}), got {tuple(rollout.shape)}")
    if importance is not None and tuple(importance.shape) != (len(maps), H):
        raise ValueError(f"view_data: importance must be (L, H) = ({len(maps)}, {H}), got {tuple(importance.shape)}")
    for name, value, count in (("layer", layer, len(maps)), ("head", head, H)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count):
            raise ValueError(f"view_data: {name} must be an int in [0, {count}) for these maps, got {value!r}")
    return {
        "tokens": [str(t) for t in tokens],
        "layers": len(maps),
        "heads": H,
        "layer_names": list(layer_names) if layer_names else [f"layer {i}" for i in range(len(maps))],
        "head_names": list(head_names) if head_names else [f"head {h}" for h in range(H)],
        "maps": [[_bytes(a[h]) for h in range(H)] for a in maps],
        "rollout": None if rollout is None else _bytes(rollout),
        "importance": None if importance is None else [[round(float(x), 6) for x in row] for row in importance],
        "start": None if layer is None and head is None else {"layer": layer or 0, "head": head or 0},
    }


def _asset(name: str) -> str:
    return (Path(__file__).with_name(name)).read_text(encoding="utf-8")


_BODY = """
<h1>{title}</h1>
{explorer}
<div id="error" role="alert"></div>
<div id="view" style="display:none">
<div class="controls"><label>layer <select id="layer"></select></label><label>head <select id="head"></select></label>
<span id="info"></span></div>
<div class="panel"><div id="head-title"></div>
<div class="map"><div class="corner">query \\ key</div><canvas class="axis" id="head-canvas-keys"></canvas>
<canvas class="axis" id="head-canvas-queries"></canvas><canvas id="head-canvas"></canvas></div>
<div id="top"></div></div>
<div class="panel" id="rollout-panel"><div>attention rollout (Abnar &amp; Zuidema 2020)</div>
<div class="map"><div class="corner">query \\ key</div><canvas class="axis" id="rollout-canvas-keys"></canvas>
<canvas class="axis" id="rollout-canvas-queries"></canvas><canvas id="rollout-canvas"></canvas></div></div>
<div class="panel" id="importance-panel"><div>head importance (Michel et al. 2019), rows: layers</div>
<table class="imp" id="importance"></table></div>
<div><div>model view: every layer (rows) and head (columns); click one to open it</div>
<div class="grid" id="model-grid"></div></div>
<p id="tokens"></p>
</div>
"""


def render_page(data: dict | None, *, title: str = "qkv attention", explorer: str = "") -> str:
    """The whole page as one string: inline style, script and (when given) data."""
    if data is not None and not isinstance(data, dict):
        raise TypeError(f"render_page: data must be view_data(...)'s dict or None, got {type(data).__name__}")
    payload = "" if data is None else json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_html.escape(title)}</title><style>{_asset('view.css')}</style></head><body>"
            + _BODY.format(title=_html.escape(title), explorer=explorer)
            + f'<script type="application/json" id="qkv-data">{payload}</script>'
            + f"<script>{_asset('view.js')}</script></body></html>\n")


def attention_html(path: str | Path, tokens: Sequence[str], maps: Sequence[torch.Tensor], *,
                   rollout: torch.Tensor | None = None, importance: torch.Tensor | None = None,
                   title: str = "qkv attention", layer_names: Sequence[str] | None = None, layer: int = 0,
                   head: int = 0) -> Path:
    """Write the self-contained head/model view to ``path``, opening on ``layer`` and ``head`` (see
    :func:`view_data` for the arguments).

    Example:
        >>> import torch, tempfile, pathlib
        >>> maps = [torch.softmax(torch.randn(2, 3, 3), -1)]
        >>> p = attention_html(pathlib.Path(tempfile.mkdtemp()) / "a.html", ["a", "b", "c"], maps)
        >>> "http" in p.read_text().split("<script>")[1]
        False
    """
    data = view_data(tokens, maps, rollout=rollout, importance=importance, layer_names=layer_names, layer=layer,
                     head=head)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(data, title=title), encoding="utf-8")
    return path
