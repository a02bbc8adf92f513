"""``qkv explore``: a local page where you type text and see the bundled all-MiniLM-L6-v2's attention (or that of
any checkpoint ``qkv.models.from_hf`` loads, ``--model DIR``).

A small HTTP server (Python's ``http.server``, bound to 127.0.0.1 unless ``--host`` says otherwise) serves one
self-contained page (inline script and style, no third-party assets) and one JSON endpoint,
``POST /api/attention`` with ``{"text": ...}``: every layer's and head's map (captured on the model's fast
backend), attention rollout (Abnar & Zuidema 2020) and head importance (Michel et al. 2019, computed once at
start-up with :func:`qkv.interpret.sentences.encoder_head_importance`). Input is bounded: past
``--max-chars`` characters or ``--max-tokens`` tokens the request is refused (HTTP 413) and the page shows
why.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "make_server", "ExplorerApp"]

_EXPLORER = """
<div class="controls"><textarea id="text" maxlength="{max_chars}"
placeholder="Type a sentence (at most {max_tokens} tokens)">The animal didn't cross the street because it was too tired.
</textarea></div>
<div class="controls"><button id="go">Show attention</button><span id="status"></span>
<span>limits: {max_chars} characters, {max_tokens} tokens</span></div>
<script>
document.addEventListener("DOMContentLoaded", function () {{
  const go = document.getElementById("go"), status = document.getElementById("status");
  const error = document.getElementById("error");
  async function run() {{
    status.textContent = "computing..."; error.textContent = "";
    try {{
      const r = await fetch("/api/attention", {{method: "POST", headers: {{"Content-Type": "application/json"}},
        body: JSON.stringify({{text: document.getElementById("text").value}})}});
      const body = await r.json();
      if (!r.ok) {{ error.textContent = body.error; status.textContent = ""; return; }}
      window.qkvRender(body); status.textContent = `${{body.tokens.length}} tokens`;
    }} catch (e) {{ error.textContent = "request failed: " + e; status.textContent = ""; }}
  }}
  go.onclick = run;
  if (document.getElementById("text").value.trim()) run();  // the example sentence is drawn on load, not blank
}});
</script>
"""


class ExplorerApp:
    """What the server needs: the encoder, the limits and the precomputed head importance; thread-safe."""

    def __init__(self, encoder, *, max_chars: int = 2000, max_tokens: int = 128, importance=None,
                 name: str = "all-MiniLM-L6-v2") -> None:
        if not isinstance(max_tokens, int) or not 2 <= max_tokens <= encoder.max_seq_length:
            raise ValueError(f"explore: max_tokens must be an int in [2, {encoder.max_seq_length}], got {max_tokens!r}")
        if not isinstance(max_chars, int) or max_chars < 1:
            raise ValueError(f"explore: max_chars must be a positive int, got {max_chars!r}")
        self.encoder, self.max_chars, self.max_tokens = encoder, max_chars, max_tokens
        self.importance, self.name = importance, name
        self._lock = threading.Lock()  # capture swaps the modules' attention_fn: one request at a time

    def page(self) -> str:
        from qkv.interpret.html import render_page

        return render_page(None, title=f"qkv explore: {self.name} attention",
                           explorer=_EXPLORER.format(max_chars=self.max_chars, max_tokens=self.max_tokens))

    def analyze(self, text) -> tuple[int, dict]:
        """(HTTP status, JSON body) for one request's text."""
        from qkv.interpret.html import view_data

        from .attention import text_attention

        if not isinstance(text, str) or not text.strip():
            return HTTPStatus.BAD_REQUEST, {"error": "empty input: type a sentence"}
        if len(text) > self.max_chars:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {
                "error": f"input too long: {len(text)} characters; the limit is {self.max_chars} characters"}
        with self._lock:
            try:
                ta = text_attention(self.encoder, text, max_tokens=self.max_tokens)
            except ValueError as e:
                return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"input too long: {e}"}
        return HTTPStatus.OK, view_data(ta.tokens, ta.maps, rollout=ta.rollout, importance=self.importance)


def _handler(app: ExplorerApp):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the command prints the address once
            pass

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, payload: dict) -> None:
            self._send(status, json.dumps(payload, separators=(",", ":")).encode(), "application/json")

        def do_GET(self) -> None:
            if self.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, app.page().encode("utf-8"), "text/html; charset=utf-8")
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/api/attention":
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {self.path}"})
                return
            raw = (self.headers.get("Content-Length") or "0").strip()
            if not raw.isdigit():
                self.close_connection = True  # the body's end is unknown: do not read it, reply and close
                self._json(HTTPStatus.BAD_REQUEST, {"error": f"Content-Length must be a byte count, got {raw[:40]!r}"})
                return
            length = int(raw)
            if length > 8 * app.max_chars + 1024:  # UTF-8 and JSON escapes stay well inside this
                self.rfile.read(min(length, 1 << 20))
                self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {
                    "error": f"input too long: {length} bytes; the limit is {app.max_chars} characters"})
                return
            try:
                text = json.loads(self.rfile.read(length) or b"{}").get("text")
                if isinstance(text, str):
                    text.encode("utf-8")  # a lone surrogate ("\ud800") is valid JSON but no text
            except (ValueError, AttributeError, RecursionError):  # UnicodeError is a ValueError
                self._json(HTTPStatus.BAD_REQUEST, {"error": 'send JSON like {"text": "a sentence"} (UTF-8 text, '
                                                             'not nested)'})
                return
            try:
                status, body = app.analyze(text)
            except Exception as e:  # every request gets a reply; the server keeps serving
                status, body = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"}
            self._json(status, body)

    return Handler


def make_server(app: ExplorerApp, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    """The HTTP server for ``app`` (port 0 picks a free one: ``server.server_address``)."""
    server = ThreadingHTTPServer((host, port), _handler(app))
    server.daemon_threads = True
    return server


def explore(
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="TCP port (0: any free one).")] = 8765,
    host: Annotated[str, typer.Option("--host", help="Address to bind; the default serves this machine only.")]
    = "127.0.0.1",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Longest input in tokens (at most 256).")] = 128,
    max_chars: Annotated[int, typer.Option("--max-chars", help="Longest input in characters.")] = 2000,
    importance: Annotated[bool, typer.Option("--importance/--no-importance",
                                             help="Compute head importance at start-up (bundled model).")] = True,
    model: Annotated[Path | None, typer.Option("--model", "-m", help="A checkpoint directory qkv.models.from_hf "
                                               "loads (encoder or decoder), its tokenizer beside it; default: the "
                                               "bundled all-MiniLM-L6-v2.")] = None,
) -> None:
    """Serve a local page showing a model's attention for any text (the bundled all-MiniLM-L6-v2, or --model DIR):
    every layer and head, rollout, and for the bundled model head importance.

    Examples:

        qkv explore            # then open http://127.0.0.1:8765

        qkv explore --port 0 --max-tokens 64

        qkv explore --model ./my-qwen3-checkpoint
    """
    from .attention import bundled_encoder

    try:
        imp = None
        if model is not None:
            from .checkpoint_text import CheckpointText

            encoder = CheckpointText(model)
            if importance:
                typer.echo(f"note: head importance is computed on the bundled sentence encoder only; {encoder.name} "
                           "shows maps and rollout (pass --no-importance to silence this)", err=True)
        else:
            encoder = bundled_encoder()
        if importance and model is None:
            from qkv.interpret.sentences import encoder_head_importance

            typer.echo("computing head importance (Michel et al. 2019) on the bundled sentences...", err=True)
            imp = encoder_head_importance(encoder)
        name = "all-MiniLM-L6-v2" if model is None else encoder.name
        app = ExplorerApp(encoder, max_chars=max_chars, max_tokens=max_tokens, importance=imp, name=name)
        server = make_server(app, host, port)
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    h, p = server.server_address[:2]
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: serving on {host}, reachable from other machines", err=True)
    typer.echo(f"qkv explore: http://{h}:{p}/  (Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def register(app: typer.Typer) -> None:
    """Add ``explore`` to ``app``."""
    app.command("explore")(explore)
