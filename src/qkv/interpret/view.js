// qkv attention view: draws attention maps on <canvas> from base64 bytes (round(255 * p / max p) per cell,
// with max p as "scale").
// No network, no dependencies. window.qkvRender(data) draws a page; data comes from qkv.interpret.html.view_data.
(function () {
  "use strict";
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const state = { data: null, layer: 0, head: 0, cache: {}, row: 0, labels: {} };
  const FONT = "11px monospace", LINE = 12, LABEL_MAX = 140;

  function el(id) { return document.getElementById(id); }

  function color(t) {
    t = Math.max(0, Math.min(1, t));
    const x = t * 4, i = Math.min(3, Math.floor(x)), f = x - i;
    const a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
  }

  function decode(s) {
    const bin = atob(s), out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function mapOf(l, h) {
    const key = l + ":" + h;
    if (!(key in state.cache)) state.cache[key] = decode(state.data.maps[l][h].b64);
    return state.cache[key];
  }

  function scaleOf(l, h) { return state.data.maps[l][h].scale; }

  // One pixel per cell, colour scaled to the map's maximum.
  function imageOf(bytes, n) {
    const c = document.createElement("canvas");
    c.width = n; c.height = n;
    const ctx = c.getContext("2d"), img = ctx.createImageData(n, n);
    let mx = 1;
    for (let i = 0; i < bytes.length; i++) if (bytes[i] > mx) mx = bytes[i];
    for (let i = 0; i < bytes.length; i++) {
      const rgb = color(bytes[i] / mx);
      img.data[4 * i] = rgb[0]; img.data[4 * i + 1] = rgb[1]; img.data[4 * i + 2] = rgb[2]; img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    return c;
  }

  function draw(canvas, bytes, n, side) {
    const scale = Math.max(1, Math.floor(side / n));
    canvas.width = n * scale; canvas.height = n * scale;
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(imageOf(bytes, n), 0, 0, n * scale, n * scale);
    canvas.dataset.scale = scale;
    return scale;
  }

  // Token labels beside a map drawn at `scale` px per cell: query tokens down the left canvas (one per row),
  // key tokens rotated across the top canvas (one per column); every token when a cell is a text line high,
  // else every step-th token with its index. state.labels[id] records what went where (tests read it).
  function labelText(tokens, i, step) {
    let t = step > 1 ? i + ":" + tokens[i] : tokens[i];
    return t.length > 16 ? t.slice(0, 15) + "\u2026" : t;
  }

  function drawLabels(id, tokens, scale) {
    const n = tokens.length, step = Math.max(1, Math.ceil(LINE / scale)), side = n * scale;
    const rows = el(id + "-queries"), cols = el(id + "-keys");
    const probe = rows.getContext("2d");
    probe.font = FONT;
    const picked = [];
    for (let i = 0; i < n; i += step) picked.push([i, labelText(tokens, i, step)]);
    let wide = 0;
    picked.forEach(([, t]) => { wide = Math.max(wide, probe.measureText(t).width); });
    const room = Math.min(LABEL_MAX, Math.ceil(wide) + 6);
    rows.width = room; rows.height = side; cols.width = side; cols.height = room;
    const placed = { step: step, queries: [], keys: [] };
    let ctx = rows.getContext("2d");
    ctx.font = FONT; ctx.fillStyle = "#222"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
    picked.forEach(([i, t]) => {
      const y = i * scale + scale / 2;
      ctx.fillText(t, room - 3, y, room - 4);
      placed.queries.push([i, t, y]);
    });
    ctx = cols.getContext("2d");
    ctx.font = FONT; ctx.fillStyle = "#222"; ctx.textAlign = "left"; ctx.textBaseline = "middle";
    picked.forEach(([j, t]) => {
      const x = j * scale + scale / 2;
      ctx.save(); ctx.translate(x, room - 3); ctx.rotate(-Math.PI / 2); ctx.fillText(t, 0, 0, room - 4); ctx.restore();
      placed.keys.push([j, t, x]);
    });
    state.labels[id] = placed;
  }

  function topKeys(bytes, n, row, k) {
    const r = [];
    for (let j = 0; j < n; j++) r.push([bytes[row * n + j], j]);
    r.sort((a, b) => b[0] - a[0]);
    return r.slice(0, k);
  }

  function showRow(row) {
    const d = state.data, n = d.tokens.length, bytes = mapOf(state.layer, state.head);
    const s = scaleOf(state.layer, state.head) / 255;
    state.row = row;
    const top = topKeys(bytes, n, row, 5).map(([v, j]) => `${d.tokens[j]} (${(v * s).toFixed(2)})`).join(", ");
    el("top").textContent = `query ${row} '${d.tokens[row]}' attends most to: ${top}`;
  }

  function cellAt(canvas, e, scale) {
    const r = canvas.getBoundingClientRect(), s = canvas.width / r.width;
    return [Math.floor((e.clientY - r.top) * s / scale), Math.floor((e.clientX - r.left) * s / scale)];
  }

  function interactive(canvas, getBytes, getScale, scale, clickRows) {
    canvas.onmousemove = function (e) {
      const d = state.data, n = d.tokens.length, [i, j] = cellAt(canvas, e, scale);
      if (i < 0 || j < 0 || i >= n || j >= n) return;
      const v = getBytes()[i * n + j] / 255 * getScale();
      el("info").textContent = `query ${i} '${d.tokens[i]}' -> key ${j} '${d.tokens[j]}': ${v.toFixed(3)}`;
    };
    if (clickRows) {
      canvas.onclick = function (e) {
        const [i] = cellAt(canvas, e, scale);
        if (i >= 0 && i < state.data.tokens.length) showRow(i);
      };
    }
  }

  function renderHead() {
    const d = state.data, n = d.tokens.length, c = el("head-canvas");
    const scale = draw(c, mapOf(state.layer, state.head), n, Math.min(720, Math.max(n, 240)));
    drawLabels("head-canvas", d.tokens, scale);
    interactive(c, () => mapOf(state.layer, state.head), () => scaleOf(state.layer, state.head), scale, true);
    c.dataset.layer = state.layer; c.dataset.head = state.head;
    el("head-title").textContent = `${d.layer_names[state.layer]}, ${d.head_names[state.head]} (${n} tokens)`;
    el("tokens").textContent = n <= 400 ? d.tokens.map((t, i) => i + ":" + t).join("  ") : `${n} tokens (hover the map)`;
    showRow(state.row < n ? state.row : 0);
  }

  function label(text, cls) {
    const s = document.createElement("div");
    s.className = cls || "lbl"; s.textContent = text;
    return s;
  }

  function renderModel() {
    const d = state.data, n = d.tokens.length, g = el("model-grid");
    g.innerHTML = "";
    g.style.gridTemplateColumns = `70px repeat(${d.heads}, 84px)`;
    g.appendChild(label(""));
    for (let h = 0; h < d.heads; h++) g.appendChild(label(h));
    for (let l = 0; l < d.layers; l++) {
      g.appendChild(label(d.layer_names[l]));
      for (let h = 0; h < d.heads; h++) {
        const c = document.createElement("canvas");
        c.width = 80; c.height = 80; c.className = "thumb";
        c.getContext("2d").drawImage(imageOf(mapOf(l, h), n), 0, 0, 80, 80);
        c.onclick = function () {
          state.layer = l; state.head = h; el("layer").value = l; el("head").value = h; renderHead();
        };
        g.appendChild(c);
      }
    }
  }

  function cell(text, cls) {
    const c = document.createElement("td");
    c.textContent = text;
    if (cls) c.className = cls;
    return c;
  }

  function renderExtras() {
    const d = state.data, n = d.tokens.length;
    el("rollout-panel").style.display = d.rollout ? "" : "none";
    if (d.rollout) {
      const bytes = decode(d.rollout.b64), rc = el("rollout-canvas");
      const scale = draw(rc, bytes, n, Math.min(480, Math.max(n, 200)));
      drawLabels("rollout-canvas", d.tokens, scale);
      interactive(rc, () => bytes, () => d.rollout.scale, scale, false);
    }
    const t = el("importance");
    t.innerHTML = "";
    el("importance-panel").style.display = d.importance ? "" : "none";
    if (!d.importance) return;
    let mx = 1e-12;
    d.importance.forEach(r => r.forEach(v => { if (v > mx) mx = v; }));
    const head = document.createElement("tr");
    head.appendChild(cell("", "lbl"));
    for (let h = 0; h < d.heads; h++) head.appendChild(cell(h, "lbl"));
    t.appendChild(head);
    d.importance.forEach((r, l) => {
      const tr = document.createElement("tr");
      tr.appendChild(cell(l, "lbl"));
      r.forEach(v => {
        const c = cell(v.toFixed(2)), rgb = color(v / mx);
        c.style.background = `rgb(${rgb.map(Math.round).join(",")})`;
        c.title = String(v);
        tr.appendChild(c);
      });
      t.appendChild(tr);
    });
  }

  function fill(sel, names) {
    sel.innerHTML = "";
    names.forEach((name, i) => {
      const o = document.createElement("option");
      o.value = i; o.textContent = name;
      sel.appendChild(o);
    });
  }

  window.qkvRender = function (data) {
    state.data = data; state.cache = {}; state.labels = {};
    if (data.start) { state.layer = data.start.layer; state.head = data.start.head; }
    state.layer = Math.min(state.layer, data.layers - 1);
    state.head = Math.min(state.head, data.heads - 1);
    fill(el("layer"), data.layer_names); fill(el("head"), data.head_names);
    el("layer").value = state.layer; el("head").value = state.head;
    el("view").style.display = "";
    renderHead(); renderModel(); renderExtras();
  };
  window.qkvState = state;
  // The RGBA of one pixel of a canvas (tests read what was drawn).
  window.qkvPixel = function (id, x, y) {
    return Array.from(el(id).getContext("2d").getImageData(x, y, 1, 1).data);
  };
  window.qkvColor = color;

  document.addEventListener("DOMContentLoaded", function () {
    el("layer").onchange = e => { state.layer = +e.target.value; renderHead(); };
    el("head").onchange = e => { state.head = +e.target.value; renderHead(); };
    const src = el("qkv-data");
    if (src && src.textContent.trim()) window.qkvRender(JSON.parse(src.textContent));
  });
})();
