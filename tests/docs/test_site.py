"""The documentation site, tested like code: it builds in strict mode with every executed page run afresh,
every public name has an entry, every internal link and anchor resolves, and it renders in a real browser.

The build runs once per test session (the ``site`` fixture) into the session's temporary folder, with
``QKV_DOCS_EXECUTE=force`` so each page's cells run against this tree's qkv (no cached outputs). The browser
test drives Debian's headless Chromium through Selenium, as tests/cli/test_explore.py does, and saves its
screenshots under its ``tmp_path``.
"""

from __future__ import annotations

import functools
import http.server
import importlib
import os
import re
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.xdist_group("docs_site")  # one worker builds the site once for all these tests

sys.path.insert(0, str(DOCS / "_ext"))


def sphinx_build(src: Path, out: Path, *, execute: str = "force", timeout: float = 900) -> subprocess.CompletedProcess:
    """``make docs``'s command (strict: -W -n), into ``out``; the execution cache inside ``out``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", QKV_DOCS_EXECUTE=execute, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "-n", "--keep-going", "-E", "-j", "2", "-q",
           "-d", str(out / "doctrees"), str(src), str(out / "html")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def docs_extra() -> None:
    """Sphinx and MyST-NB, the docs extra: the tests that build skip without it (a partial install)."""
    pytest.importorskip("sphinx", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("myst_nb", reason="the docs extra is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="session")
def site(tmp_path_factory, docs_extra) -> Path:
    out = tmp_path_factory.mktemp("docs_site")
    start = time.monotonic()
    proc = sphinx_build(DOCS, out)
    noise = "Kernel is running over TCP without encryption"  # ipykernel's note on its local socket
    log = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if noise not in line)
    assert proc.returncode == 0, f"the strict docs build failed:\n{log[-8000:]}"
    (out / "build_seconds.txt").write_text(f"{time.monotonic() - start:.1f}\n")
    return out / "html"


def test_site_builds_strict_and_executes_every_page(site):
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    for name in ("index.html", "conventions.html", "matrices.html", "api/qkv.html", "tutorials/06_flash.html",
                 "migration/flash_attn.html"):
        assert name in pages, f"{name} missing from the built site: {pages}"
    executed = [p.stem for p in (DOCS / "tutorials").glob("[0-9]*.md")]
    assert len(executed) >= 10, executed
    for stem in executed:  # each tutorial ran: it holds outputs and a figure drawn by the run
        html = (site / "tutorials" / f"{stem}.html").read_text()
        assert "cell_output" in html, f"tutorial {stem} has no executed output"
        assert re.search(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', html), f"tutorial {stem} has no figure"


def test_every_public_name_has_an_entry(site):
    """Each name in each documented module's ``__all__``: its own entry (an element with its full name as id),
    a line saying which entry documents the same object, or for a module, a link to its page."""
    import types

    from qkv_apigen import MODULES, public_names

    missing = []
    for module in MODULES:
        html = (site / "api" / f"{module}.html").read_text()
        mod = importlib.import_module(module)
        for name in public_names(mod):
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType):
                ok = f'href="{obj.__name__}.html"' in html and (site / "api" / f"{obj.__name__}.html").exists()
            else:
                ok = (f'id="{module}.{name}"' in html
                      or f'<span class="pre">{name}</span></code>: the same object as' in html)
            if not ok:
                missing.append(f"{module}.{name}")
    assert not missing, f"public names without an API entry: {missing}"


def test_matrices_page_shows_both_matrices(site):
    html = (site / "matrices.html").read_text()
    assert "declined and raising" in html and "accepted and agreeing with the float64 reference" in html
    from qkv_matrix import registered_families

    for model_type in registered_families():
        assert f"<td>{model_type}</td>" in html or f">{model_type}<" in html, f"{model_type} missing"


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key) and (tag != "link" or attrs.get("rel") in ("stylesheet", None)):
                self.links.append(attrs[key])


@functools.cache
def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(errors="replace"))
    return parser


def broken_links(site: Path) -> list[str]:
    """Every internal href/src of the built HTML whose file or ``#anchor`` does not exist (external links are
    not fetched: no network)."""
    broken = []
    for page in sorted(site.rglob("*.html")):
        for link in _parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(site)} -> {link}"
            if not target.exists():
                broken.append(f"{where} (no file)")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in _parse(target).ids:
                broken.append(f"{where} (no anchor)")
    return broken


def test_internal_links_and_anchors_resolve(site):
    assert not broken_links(site), "broken internal links:\n" + "\n".join(broken_links(site)[:50])


def test_link_check_finds_a_planted_broken_link(site, tmp_path):
    import shutil

    copy = tmp_path / "html"
    shutil.copytree(site, copy)
    page = copy / "conventions.html"
    page.write_text(page.read_text().replace("</body>", '<a href="matrices.html#no-such-anchor">x</a>'
                                             '<a href="nowhere.html">y</a></body>'))
    _parse.cache_clear()
    found = broken_links(copy)
    assert any("no-such-anchor" in b for b in found) and any("nowhere.html" in b for b in found), found


def test_strict_build_fails_on_a_broken_reference(tmp_path, docs_extra):
    """The strict flags bite: a page naming an object that does not exist fails the build."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(f"exec(open({str(DOCS / 'conf.py')!r}).read().replace('__file__', "
                                 f"repr({str(DOCS / 'conf.py')!r})))\n")
    (src / "index.md").write_text("# t\n\nSee {py:func}`qkv.merge_states` and {py:func}`qkv.no_such_function`."
                                  "\n\n```{toctree}\n:hidden:\n\napi/index\n```\n")
    proc = sphinx_build(src, tmp_path / "out", timeout=300)
    assert proc.returncode != 0 and "no_such_function" in proc.stderr, proc.stderr[-2000:]


def test_matrix_check_catches_a_cell_that_disagrees():
    import qkv_matrix

    cpu = qkv_matrix.backend_matrix("cpu")
    wrong = dict(cpu)
    wrong[("return_lse", "sdpa")] = None  # claim SDPA returns the lse: the check must find it raises
    with pytest.raises(qkv_matrix.MatrixMismatch, match="return_lse"):
        qkv_matrix.verify_backend_matrix(wrong, "cpu")
    wrong = dict(cpu)
    wrong[("causal (bottom-right)", "tiled")] = "made up"  # claim tiled declines: the check must find it runs
    with pytest.raises(qkv_matrix.MatrixMismatch, match="ran it"):
        qkv_matrix.verify_backend_matrix(wrong, "cpu")


from _browser import CHROMEDRIVER, CHROMIUM, headless_chrome  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        pytest.skip(f"headless Chromium not found at {CHROMIUM} and {CHROMEDRIVER}: install Debian's packages with "
                    "`apt-get install chromium chromium-driver` (make test does when run as root)")
    pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install selenium")
    for driver in headless_chrome(1300):
        driver.set_page_load_timeout(60)
        yield driver


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on localhost (the search page loads its index as a script)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _wait(driver, script: str, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _image_drawn(driver, selector: str) -> bool:
    return driver.execute_script(
        "const i = document.querySelector(arguments[0]); return !!i && i.complete && i.naturalWidth > 50;", selector)


def test_browser_renders_index_tutorial_api_and_search(browser, served, tmp_path):
    browser.get(f"{served}/index.html")
    assert "qkv" in browser.title, browser.title
    assert _wait(browser, "return document.querySelector('div.highlight pre') !== null", "a code block")
    browser.save_screenshot(str(tmp_path / "index.png"))

    browser.get(f"{served}/tutorials/06_flash.html")
    assert "online softmax" in browser.title.lower(), browser.title
    assert _wait(browser, "return document.querySelectorAll('div.cell_output').length > 0", "executed outputs")
    assert _wait(browser, "const i = document.querySelector('img[src*=\"_images/\"]');"
                          "return !!i && i.complete && i.naturalWidth > 50;", "the tutorial's figure")
    browser.save_screenshot(str(tmp_path / "tutorial.png"))

    browser.get(f"{served}/api/qkv.html#qkv.attention")
    assert "qkv" in browser.title, browser.title
    assert _wait(browser, "return document.getElementById('qkv.attention') !== null", "the qkv.attention entry")
    text = browser.execute_script("return document.getElementById('qkv.attention').parentElement.innerText;")
    assert "Scaled dot-product attention" in text and "return_lse" in text, text[:500]
    assert browser.execute_script("return document.querySelector('div.highlight pre, pre') !== null")
    browser.save_screenshot(str(tmp_path / "api_attention.png"))

    browser.get(f"{served}/search.html?q=merge_states")
    hits = _wait(browser, "const r = document.querySelectorAll('#search-results li a, ul.search li a');"
                          "return r.length ? Array.from(r).map(a => a.getAttribute('href')) : null;",
                 "search results for merge_states", timeout=60)
    assert any("api/qkv.html" in h or "conventions.html" in h for h in hits), hits
    browser.save_screenshot(str(tmp_path / "search.png"))
    for name in ("index", "tutorial", "api_attention", "search"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    print(f"screenshots in {tmp_path}")
