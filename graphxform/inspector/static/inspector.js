/* graphxform inspector page: explore a collapsed graph (see graphxform/inspector/html.py).

   The page holds the scope tree and the folded leaves; what is on screen is the set of boxes
   under the open scopes. Each change (open, close, colour) recomputes the boxes with one sweep
   over the tree, bundles the leaves' inputs into edges between boxes, and lays out only those
   boxes: a layered layout (cycles broken by DFS, longest-path layers with sources pulled down
   next to their consumers, barycentric ordering, packing toward the neighbours). Boxes with
   very many neighbours (hubs: the Saver, the optimizer, served names) are drawn aside and
   their edges shown only while they are selected, as TensorBoard does. */
(function () {
  "use strict";

  var doc = JSON.parse(document.getElementById("graph-data").textContent);
  var T = doc.tree, L = doc.leaves;
  var N = T.parent.length, LEAVES = L.op.length;
  var SCOPE = 0, GROUP = 1, OP = 2;
  var BOX_H = 46, LAYER_GAP = 34, BOX_GAP = 16, MAX_ROW = 14;
  var PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
                 "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"];
  var DIFF_COLOURS = {added: "#4daf4a", removed: "#e41a1c", replaced: "#984ea3",
                      rewired: "#ff7f00", changed: "#377eb8", unchanged: "#eeeeee"};
  var SVG = "http://www.w3.org/2000/svg";

  var errors = 0;
  window.addEventListener("error", function (event) {
    errors += 1;
    document.body.dataset.errors = String(errors);
    var status = document.getElementById("status");
    status.textContent = "error: " + event.message;
    status.className = "error";
  });

  // ------------------------------------------------------------------ the tree
  var children = [];
  var k, p;
  for (k = 0; k < N; k++) children.push([]);
  for (k = 1; k < N; k++) children[T.parent[k]].push(k);
  var path = new Array(N);
  path[0] = "";
  for (k = 1; k < N; k++) {
    p = T.parent[k];
    while (T.kind[p] === GROUP) p = T.parent[p];
    path[k] = path[p] + T.label[k];
  }
  var byPath = null;  // path -> entry, built on first search by path

  function entryOfPath(text) {
    if (byPath === null) {
      byPath = new Map();
      for (var e = N - 1; e >= 0; e--) byPath.set(path[e], e);
    }
    var folded = text.replace(/(^|\/)replica_\d+(?=\/)/g, "$1replica_*");
    if (byPath.has(folded)) return byPath.get(folded);
    if (byPath.has(folded + "/")) return byPath.get(folded + "/");
    return -1;
  }

  function leafOf(entry) { return T.leaf[entry]; }

  function originalName(leaf) {
    if (Object.prototype.hasOwnProperty.call(L.origin, leaf)) return L.origin[leaf];
    var name = path[L.entry[leaf]];
    if (doc.tables.pass[L.pass[leaf]] === "replicate") {
      return name.replace(/(^|\/)replica_\*\//, "$1");
    }
    return name;
  }

  // ------------------------------------------------------------------ state
  var state = {open: new Set(doc.open), colorBy: doc.colorBy, selected: -1,
               matches: new Set(), view: {x: 0, y: 0, k: 1}};
  var current = null;  // what is drawn: {boxes, leafBox, edges, hubs, pos}

  function isOpen(entry) { return entry === doc.root || state.open.has(entry); }

  /* The boxes under the open scopes, each leaf's box and the bundled edges between boxes. */
  function visibleBoxes() {
    var boxEntry = new Int32Array(N).fill(-2);  // -2 hidden, -1 open, else the box's entry
    var root = doc.root, e, above;
    boxEntry[root] = T.kind[root] === OP ? root : -1;
    for (e = root + 1; e < N; e++) {
      above = boxEntry[T.parent[e]];
      if (above === -2) continue;
      if (above === -1) boxEntry[e] = (T.kind[e] !== OP && isOpen(e)) ? -1 : e;
      else boxEntry[e] = above;
    }
    var boxes = [], index = new Int32Array(N).fill(-1);
    for (e = 0; e < N; e++) {
      if (boxEntry[e] === e) { index[e] = boxes.length; boxes.push(e); }
    }
    var leafBox = new Int32Array(LEAVES);
    for (var leaf = 0; leaf < LEAVES; leaf++) {
      var b = boxEntry[L.entry[leaf]];
      leafBox[leaf] = b >= 0 ? index[b] : -1;
    }
    var n = boxes.length, bundled = new Map(), edges = [];
    for (leaf = 0; leaf < LEAVES; leaf++) {
      var dst = leafBox[leaf];
      if (dst < 0) continue;
      var ins = L.inputs[leaf];
      for (var i = 0; i < ins.length; i += 2) {
        var src = leafBox[ins[i]];
        if (src < 0 || src === dst) continue;
        var key = src * n + dst, edge = bundled.get(key);
        if (edge === undefined) {
          edge = {src: src, dst: dst, data: 0, control: 0};
          bundled.set(key, edge);
          edges.push(edge);
        }
        if (ins[i + 1] < 0) edge.control += 1; else edge.data += 1;
      }
    }
    var degree = new Int32Array(n);
    edges.forEach(function (edge) { degree[edge.src] += 1; degree[edge.dst] += 1; });
    var hubs = new Set();
    for (var j = 0; j < n; j++) if (degree[j] > doc.hubDegree) hubs.add(j);
    return {boxes: boxes, index: index, leafBox: leafBox, edges: edges, hubs: hubs,
            degree: degree};
  }

  // ------------------------------------------------------------------ colours
  var colourOf = {};

  function keyColour(name) {
    if (state.colorBy === "diff" && DIFF_COLOURS[name]) return DIFF_COLOURS[name];
    var table = colourOf[state.colorBy] || (colourOf[state.colorBy] = new Map());
    if (!table.has(name)) table.set(name, PALETTE[table.size % PALETTE.length]);
    return table.get(name);
  }

  /* Per box: the colour key most of its leaves have, and every key's count. */
  function boxKeys(view) {
    var keys = doc.keys[state.colorBy], counts = view.boxes.map(function () { return new Map(); });
    for (var leaf = 0; leaf < LEAVES; leaf++) {
      var b = view.leafBox[leaf];
      if (b < 0) continue;
      var m = counts[b];
      m.set(keys[leaf], (m.get(keys[leaf]) || 0) + 1);
    }
    return counts.map(function (m) {
      var best = -1, most = -1;
      m.forEach(function (count, key) {
        if (count > most || (count === most && key < best)) { best = key; most = count; }
      });
      return {key: best, counts: m};
    });
  }

  // ------------------------------------------------------------------ layout
  function boxText(entry) {
    var kind = T.kind[entry], label = T.label[entry], sub;
    if (kind === OP) sub = doc.tables.op[L.op[leafOf(entry)]];
    else sub = T.size[entry] + (T.size[entry] === 1 ? " op" : " ops");
    var copies = replicasOf(entry);
    if (copies > 1) sub += "  \u00d7 " + copies;
    var parent = T.parent[entry], caption = "";
    if (parent > 0) caption = clip(path[parent] || T.label[parent], 40, true);
    return {caption: caption, label: clip(label, 38, false), sub: sub};
  }

  function replicasOf(entry) {
    if (path[entry].indexOf("replica_*") < 0) return 0;
    if (T.kind[entry] === OP) return L.replicas[leafOf(entry)].length;
    return doc.replicas;
  }

  function clip(text, limit, fromLeft) {
    if (text.length <= limit) return text;
    return fromLeft ? "\u2026" + text.slice(text.length - limit + 1)
                    : text.slice(0, limit - 1) + "\u2026";
  }

  function boxWidth(text) {
    var longest = Math.max(text.label.length, text.sub.length, text.caption.length * 0.8);
    return Math.max(70, Math.min(300, 12 + longest * 6.4));
  }

  /* Positions {x, y, w} of every box (centres): hubs and boxes without edges in a column
     block on the left, the rest in layers. */
  function layout(view) {
    var n = view.boxes.length, i, j;
    var texts = view.boxes.map(boxText), width = texts.map(boxWidth);
    var out = [], into = [];
    for (i = 0; i < n; i++) { out.push([]); into.push([]); }
    var linked = new Uint8Array(n);
    view.edges.forEach(function (edge) {
      if (view.hubs.has(edge.src) || view.hubs.has(edge.dst)) return;
      out[edge.src].push(edge.dst);
      into[edge.dst].push(edge.src);
      linked[edge.src] = linked[edge.dst] = 1;
    });
    var main = [], aside = [];
    for (i = 0; i < n; i++) (linked[i] && !view.hubs.has(i) ? main : aside).push(i);

    // break cycles: edges to a node still on the DFS stack are reversed
    var mark = new Uint8Array(n), succ = [], pred = [];
    for (i = 0; i < n; i++) { succ.push([]); pred.push([]); }
    main.forEach(function (start) {
      if (mark[start]) return;
      var stack = [[start, 0]];
      mark[start] = 1;
      while (stack.length) {
        var top = stack[stack.length - 1], v = top[0];
        if (top[1] < out[v].length) {
          var w = out[v][top[1]++];
          if (mark[w] === 1) { succ[w].push(v); pred[v].push(w); continue; }
          succ[v].push(w); pred[w].push(v);
          if (!mark[w]) { mark[w] = 1; stack.push([w, 0]); }
        } else {
          mark[v] = 2;
          stack.pop();
        }
      }
    });

    // longest-path layers in topological order, then sources next to their first consumer
    var layer = new Int32Array(n), waiting = new Int32Array(n), order = [];
    main.forEach(function (v) { waiting[v] = pred[v].length; if (!waiting[v]) order.push(v); });
    for (i = 0; i < order.length; i++) {
      var v = order[i];
      succ[v].forEach(function (w) {
        layer[w] = Math.max(layer[w], layer[v] + 1);
        if (--waiting[w] === 0) order.push(w);
      });
    }
    for (i = order.length - 1; i >= 0; i--) {
      v = order[i];
      if (pred[v].length || !succ[v].length) continue;
      var lowest = Infinity;
      succ[v].forEach(function (w) { lowest = Math.min(lowest, layer[w]); });
      layer[v] = lowest - 1;
    }
    var layers = [];
    order.forEach(function (v) {
      while (layers.length <= layer[v]) layers.push([]);
      layers[layer[v]].push(v);
    });
    layers.forEach(function (row) { row.sort(function (a, b) { return a - b; }); });

    var x = new Float64Array(n);
    function pack(row) {
      var total = row.reduce(function (s, v) { return s + width[v] + BOX_GAP; }, -BOX_GAP);
      var at = -total / 2;
      row.forEach(function (v) { x[v] = at + width[v] / 2; at += width[v] + BOX_GAP; });
    }
    layers.forEach(pack);
    function barycenter(v, side) {
      var list = side[v];
      if (!list.length) return null;
      var s = 0;
      list.forEach(function (w) { s += x[w]; });
      return s / list.length;
    }
    function sweep(rows, side) {
      rows.forEach(function (row) {
        var keyed = row.map(function (v, index) {
          var b = barycenter(v, side);
          return {v: v, b: b === null ? x[v] : b, index: index};
        });
        keyed.sort(function (a, b) { return a.b - b.b || a.index - b.index; });
        for (var q = 0; q < row.length; q++) row[q] = keyed[q].v;
        pack(row);
      });
    }
    for (var round = 0; round < 4; round++) {
      sweep(layers.slice(1), pred);
      sweep(layers.slice(0, -1).reverse(), succ);
    }
    // place each layer near its neighbours, keeping its order and gaps
    function place(row, side) {
      var want = row.map(function (v) { var b = barycenter(v, side); return b === null ? x[v] : b; });
      var at = -Infinity;
      row.forEach(function (v, q) {
        x[v] = Math.max(want[q], at + width[v] / 2);
        at = x[v] + width[v] / 2 + BOX_GAP;
      });
      var shift = 0;
      row.forEach(function (v, q) { shift += want[q] - x[v]; });
      shift /= row.length || 1;
      row.forEach(function (v) { x[v] += shift; });
    }
    for (round = 0; round < 2; round++) {
      layers.slice(1).forEach(function (row) { place(row, pred); });
      layers.slice(0, -1).reverse().forEach(function (row) { place(row, succ); });
    }

    // a crowded layer wraps onto several rows, so the picture stays near the window's shape
    var pos = new Array(n);
    var minX = Infinity, y = 0;
    layers.forEach(function (row) {
      for (var start = 0; start < row.length; start += MAX_ROW) {
        var part = row.slice(start, start + MAX_ROW);
        if (row.length > MAX_ROW) pack(part);
        part.forEach(function (v) {
          pos[v] = {x: x[v], y: y, w: width[v], text: texts[v]};
          minX = Math.min(minX, x[v] - width[v] / 2);
        });
        y += BOX_H + (start + MAX_ROW < row.length ? 14 : LAYER_GAP);
      }
    });
    if (minX === Infinity) minX = 0;
    // the aside block: columns of up to 14 boxes left of the layers
    var column = 0, row = 0, columnWidth = 0, left = minX - 60, columns = [];
    aside.forEach(function (v) {
      if (row === 14) { columns.push(columnWidth); column += 1; row = 0; columnWidth = 0; }
      columnWidth = Math.max(columnWidth, width[v]);
      pos[v] = {col: column, y: row * (BOX_H + 12), w: width[v], text: texts[v]};
      row += 1;
    });
    columns.push(columnWidth);
    var edge = left;
    for (i = columns.length - 1; i >= 0; i--) {
      var right = edge;
      edge -= columns[i] + 24;
      for (j = 0; j < aside.length; j++) {
        var a = pos[aside[j]];
        if (a.col === i) a.x = right - columns[i] / 2;
      }
    }
    return {pos: pos, aside: aside.length ? {x: edge + 12, y: -30} : null};
  }

  // ------------------------------------------------------------------ drawing
  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG, name);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }

  function refresh(keepView) {
    var started = performance.now();
    current = visibleBoxes();
    var placed = layout(current);
    current.pos = placed.pos;
    current.keys = boxKeys(current);
    current.placed = placed;
    draw(placed);
    var took = performance.now() - started;
    var shown = current.boxes.length;
    document.getElementById("status").textContent = shown + " boxes \u00b7 " +
        current.edges.length + " edges \u00b7 laid out in " + Math.round(took) + " ms";
    document.body.dataset.boxes = String(shown);
    document.body.dataset.layoutMs = String(Math.round(took));
    if (!keepView) fit(true);
    legend();
    if (!document.body.dataset.ready) {
      document.body.dataset.loadMs = String(Math.round(performance.now()));
    }
    document.body.dataset.ready = "1";
  }

  function draw(placed) {
    var edgeLayer = document.getElementById("edges"), boxLayer = document.getElementById("boxes");
    edgeLayer.textContent = "";
    boxLayer.textContent = "";
    var pos = current.pos, selectedBox = state.selected >= 0 ? current.index[state.selected] : -1;
    if (placed.aside) {
      el("text", {x: placed.aside.x, y: placed.aside.y, "class": "aside-title"}, boxLayer)
          .textContent = "many or no edges (select one to see its edges)";
    }
    current.edges.forEach(function (edge) {
      var hub = current.hubs.has(edge.src) || current.hubs.has(edge.dst);
      if (hub && edge.src !== selectedBox && edge.dst !== selectedBox) return;
      var a = pos[edge.src], b = pos[edge.dst];
      var x1 = a.x, y1 = a.y + BOX_H / 2, x2 = b.x, y2 = b.y - BOX_H / 2;
      var bend = Math.max(30, Math.abs(y2 - y1) / 2);
      var count = edge.data + edge.control;
      var d = "M" + x1 + "," + y1 + " C" + x1 + "," + (y1 + bend) + " " + x2 + "," +
          (y2 - bend) + " " + x2 + "," + y2;
      var line = el("path", {d: d, "class": "edge" + (edge.data ? "" : " control") +
                             (hub ? " hub" : ""), "marker-end": "url(#arrow)",
                             "stroke-width": Math.min(1 + Math.log2(count) / 1.5, 5)}, edgeLayer);
      el("title", {}, line).textContent = count + (count === 1 ? " edge" : " edges") +
          (edge.control ? " (" + edge.control + " control)" : "");
      if (count > 1) {
        el("text", {x: (x1 + x2) / 2 + 3, y: (y1 + y2) / 2, "class": "edge-label"}, edgeLayer)
            .textContent = String(count);
      }
    });
    current.boxes.forEach(function (entry, i) {
      var at = pos[i], kind = T.kind[entry], w = at.w;
      var classes = ["box", kind === OP ? "op" : kind === SCOPE ? "scope" : "group"];
      var copies = replicasOf(entry);
      if (copies > 1) classes.push("replicated");
      if (current.hubs.has(i)) classes.push("hub");
      if (i === selectedBox) classes.push("selected");
      if (state.matches.has(entry)) classes.push("match");
      var g = el("g", {"class": classes.join(" "), transform: "translate(" + (at.x - w / 2) +
                       "," + (at.y - BOX_H / 2) + ")"}, boxLayer);
      g.dataset.entry = String(entry);
      var fill = keyColour(doc.keyNames[state.colorBy][current.keys[i].key]);
      if (copies > 1) el("rect", {x: 4, y: -4, width: w, height: BOX_H, rx: 6, "class": "back"}, g);
      el("rect", {width: w, height: BOX_H, rx: kind === OP ? 10 : 3, fill: fill, "class": "front"}, g);
      var text = at.text;
      el("text", {x: 6, y: 11, "class": "caption"}, g).textContent = text.caption;
      el("text", {x: 6, y: 25}, g).textContent = text.label;
      var sub = text.sub;
      if (current.hubs.has(i)) sub += "  \u2194 " + current.degree[i];
      el("text", {x: 6, y: 39, "class": "sub"}, g).textContent = sub;
      el("title", {}, g).textContent = path[entry] || "(graph)";
    });
    applyView();
  }

  function legend() {
    var box = document.getElementById("legend"), names = doc.keyNames[state.colorBy];
    var totals = new Map(), keys = doc.keys[state.colorBy];
    for (var leaf = 0; leaf < LEAVES; leaf++) totals.set(keys[leaf], (totals.get(keys[leaf]) || 0) + 1);
    var rows = Array.from(totals.entries()).sort(function (a, b) { return b[1] - a[1]; });
    box.textContent = "";
    var head = document.createElement("h3");
    head.textContent = "colour: " + state.colorBy;
    box.appendChild(head);
    var list = document.createElement("div");
    rows.slice(0, 30).forEach(function (row) {
      var line = document.createElement("div");
      var swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = keyColour(names[row[0]]);
      line.appendChild(swatch);
      line.appendChild(document.createTextNode(names[row[0]] + " (" + row[1] + ")"));
      list.appendChild(line);
    });
    box.appendChild(list);
  }

  // ------------------------------------------------------------------ view: pan and zoom
  var canvas = document.getElementById("canvas");

  function applyView() {
    var v = state.view;
    document.getElementById("viewport").setAttribute(
        "transform", "translate(" + v.x + "," + v.y + ") scale(" + v.k + ")");
  }

  /* The whole picture in the window; ``readable``: no smaller than half size, the top of a
     picture too tall for that in view (a deep model is a long chain of boxes). */
  function fit(readable) {
    var bounds = document.getElementById("viewport").getBBox();
    var w = canvas.clientWidth || 800, h = canvas.clientHeight || 600;
    if (!bounds.width || !bounds.height) return;
    var k = Math.min(w / (bounds.width + 40), h / (bounds.height + 40), 1.5);
    if (readable === true && k < 0.5) {
      k = Math.max(0.5, Math.min(1, w / (bounds.width + 40)));
      state.view = {k: k, x: (w - bounds.width * k) / 2 - bounds.x * k,
                    y: 20 - bounds.y * k};
    } else {
      state.view = {k: k, x: (w - bounds.width * k) / 2 - bounds.x * k,
                    y: (h - bounds.height * k) / 2 - bounds.y * k};
    }
    applyView();
  }

  function zoom(factor, cx, cy) {
    var v = state.view, k = Math.max(0.02, Math.min(8, v.k * factor));
    if (cx === undefined) { cx = canvas.clientWidth / 2; cy = canvas.clientHeight / 2; }
    v.x = cx - (cx - v.x) * (k / v.k);
    v.y = cy - (cy - v.y) * (k / v.k);
    v.k = k;
    applyView();
  }

  function centreOn(entry) {
    var i = current.index[entry];
    if (i < 0) return;
    var at = current.pos[i], v = state.view;
    v.k = Math.max(v.k, 0.9);
    v.x = canvas.clientWidth / 2 - at.x * v.k;
    v.y = canvas.clientHeight / 2 - at.y * v.k;
    applyView();
  }

  var drag = null;
  canvas.addEventListener("pointerdown", function (event) {
    drag = {x: event.clientX, y: event.clientY, vx: state.view.x, vy: state.view.y, moved: false};
    canvas.classList.add("panning");
  });
  window.addEventListener("pointermove", function (event) {
    if (!drag) return;
    var dx = event.clientX - drag.x, dy = event.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 4) drag.moved = true;
    state.view.x = drag.vx + dx;
    state.view.y = drag.vy + dy;
    applyView();
  });
  window.addEventListener("pointerup", function (event) {
    if (!drag) return;
    var moved = drag.moved;
    drag = null;
    canvas.classList.remove("panning");
    if (moved) return;
    var target = event.target.closest ? event.target.closest(".box") : null;
    if (target && canvas.contains(target)) clickBox(Number(target.dataset.entry));
  });
  canvas.addEventListener("wheel", function (event) {
    event.preventDefault();
    var r = canvas.getBoundingClientRect();
    zoom(event.deltaY < 0 ? 1.15 : 1 / 1.15, event.clientX - r.left, event.clientY - r.top);
  }, {passive: false});

  // ------------------------------------------------------------------ actions
  function clickBox(entry) {
    state.selected = entry;
    if (T.kind[entry] !== OP && !isOpen(entry)) {
      state.open.add(entry);
      refresh(true);
    } else {
      draw(current.placed);
    }
    details(entry);
  }

  function setOpen(entry, open) {
    if (open) state.open.add(entry); else closeBelow(entry);
    refresh(true);
    details(entry);
  }

  function closeBelow(entry) {
    state.open.delete(entry);
    var stack = children[entry].slice();
    while (stack.length) {
      var e = stack.pop();
      if (state.open.delete(e)) stack.push.apply(stack, children[e]);
    }
  }

  /* Open every scope above ``entry``, select it and bring it to the middle. */
  function reveal(entry) {
    for (var e = T.parent[entry]; e > 0; e = T.parent[e]) state.open.add(e);
    state.selected = entry;
    refresh(true);
    centreOn(entry);
    details(entry);
  }

  // ------------------------------------------------------------------ side panel
  function link(entry, text) {
    var a = document.createElement("a");
    a.textContent = text || path[entry];
    a.addEventListener("click", function () { reveal(entry); });
    return a;
  }

  function row(table, name, value) {
    var tr = document.createElement("tr"), a = document.createElement("td"),
        b = document.createElement("td");
    a.textContent = name;
    if (typeof value === "string") b.textContent = value; else b.appendChild(value);
    tr.appendChild(a);
    tr.appendChild(b);
    table.appendChild(tr);
  }

  function list(items, limit) {
    var ul = document.createElement("ul");
    items.slice(0, limit).forEach(function (item) {
      var li = document.createElement("li");
      if (typeof item === "string") li.textContent = item; else li.appendChild(item);
      ul.appendChild(li);
    });
    if (items.length > limit) {
      var more = document.createElement("li");
      more.textContent = (items.length - limit) + " more";
      ul.appendChild(more);
    }
    return ul;
  }

  function button(text, action) {
    var b = document.createElement("button");
    b.textContent = text;
    b.addEventListener("click", action);
    return b;
  }

  function details(entry) {
    var box = document.getElementById("details");
    box.textContent = "";
    var head = document.createElement("h3");
    head.textContent = path[entry] || "(whole graph)";
    box.appendChild(head);
    var table = document.createElement("table");
    box.appendChild(table);
    var copies = replicasOf(entry);
    if (T.kind[entry] === OP) {
      var leaf = leafOf(entry), made = doc.tables.pass[L.pass[leaf]];
      row(table, "op", doc.tables.op[L.op[leaf]]);
      row(table, "made by", made ? "pass " + made : "the input graph");
      var original = originalName(leaf);
      row(table, "original name", original === null ? "(none: new)" : original);
      if (copies) row(table, "copies", copies + " (replicas " + L.replicas[leaf].join(", ") + ")");
      row(table, "device", devicesText(leaf));
      var inputs = [], ins = L.inputs[leaf];
      for (var i = 0; i < ins.length; i += 2) {
        var src = L.entry[ins[i]];
        inputs.push(link(src, (ins[i + 1] < 0 ? "^" : "") + path[src] +
                         (ins[i + 1] > 0 ? ":" + ins[i + 1] : "")));
      }
      box.appendChild(document.createTextNode("inputs (" + inputs.length + ")"));
      box.appendChild(list(inputs, 40));
      var users = consumers(leaf).map(function (other) { return link(L.entry[other]); });
      box.appendChild(document.createTextNode("consumers (" + users.length + ")"));
      box.appendChild(list(users, 40));
    } else {
      row(table, "kind", T.kind[entry] === GROUP ? "group of names sharing a prefix" : "scope");
      row(table, "ops", T.size[entry] + (copies > 1 ? " per replica, \u00d7 " + copies : ""));
      row(table, "children", String(children[entry].length));
      var composition = document.createElement("div"), counts = new Map(),
          keys = doc.keys[state.colorBy], names = doc.keyNames[state.colorBy];
      var stack = [entry];
      while (stack.length) {
        var e = stack.pop();
        if (T.kind[e] === OP) {
          var key = keys[leafOf(e)];
          counts.set(key, (counts.get(key) || 0) + 1);
        } else stack.push.apply(stack, children[e]);
      }
      Array.from(counts.entries()).sort(function (a, b) { return b[1] - a[1]; }).slice(0, 8)
          .forEach(function (pair) {
            var line = document.createElement("div");
            var swatch = document.createElement("span");
            swatch.className = "swatch";
            swatch.style.background = keyColour(names[pair[0]]);
            line.appendChild(swatch);
            line.appendChild(document.createTextNode(names[pair[0]] + ": " + pair[1]));
            composition.appendChild(line);
          });
      row(table, state.colorBy, composition);
      if (entry !== doc.root) {
        box.appendChild(isOpen(entry) ? button("collapse", function () { setOpen(entry, false); })
                                      : button("expand", function () { setOpen(entry, true); }));
      }
    }
    var above = [];
    for (var a = T.parent[entry]; a > 0; a = T.parent[a]) above.unshift(a);
    if (above.length) {
      box.appendChild(document.createTextNode("inside"));
      box.appendChild(list(above.map(function (scope) {
        var span = document.createElement("span");
        span.appendChild(link(scope));
        span.appendChild(document.createTextNode(" "));
        span.appendChild(button("collapse", function () { setOpen(scope, false); }));
        return span;
      }), 20));
    }
  }

  function devicesText(leaf) {
    var devices = doc.tables.device, members = L.memberDevices[leaf];
    if (!members) return doc.keyNames.device[doc.keys.device[leaf]];
    var seen = [];
    members.forEach(function (d) { if (seen.indexOf(devices[d]) < 0) seen.push(devices[d]); });
    return seen.map(function (d) { return d || "(none)"; }).join(", ");
  }

  function consumers(leaf) {
    var found = [];
    for (var other = 0; other < LEAVES; other++) {
      var ins = L.inputs[other];
      for (var i = 0; i < ins.length; i += 2) {
        if (ins[i] === leaf) { found.push(other); break; }
      }
    }
    return found;
  }

  // ------------------------------------------------------------------ search
  var searchTimer = null;
  document.getElementById("search").addEventListener("input", function (event) {
    clearTimeout(searchTimer);
    var query = event.target.value;
    searchTimer = setTimeout(function () { search(query); }, 150);
  });

  function search(query) {
    var box = document.getElementById("results"), q = query.trim().toLowerCase();
    box.textContent = "";
    state.matches = new Set();
    if (q.length < 2) { draw(current.placed); return; }
    var found = [];
    for (var e = 1; e < N && found.length < 200; e++) {
      if (path[e].toLowerCase().indexOf(q) >= 0) found.push(e);
    }
    found.forEach(function (e) { state.matches.add(e); });
    var head = document.createElement("h3");
    head.textContent = (found.length === 200 ? "200+" : found.length) + " matching \u201c" +
        query + "\u201d";
    box.appendChild(head);
    box.appendChild(list(found.map(function (e) { return link(e); }), 60));
    draw(current.placed);
  }

  // ------------------------------------------------------------------ start
  var select = document.getElementById("color");
  Object.keys(doc.keys).forEach(function (name) {
    var option = document.createElement("option");
    option.value = option.textContent = name;
    select.appendChild(option);
  });
  select.value = state.colorBy;
  select.addEventListener("change", function () {
    state.colorBy = select.value;
    refresh(true);
    if (state.selected >= 0) details(state.selected);
  });
  document.getElementById("fit").addEventListener("click", function () { fit(false); });
  document.getElementById("zoom-in").addEventListener("click", function () { zoom(1.25); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoom(0.8); });
  document.getElementById("reset").addEventListener("click", function () {
    state.open = new Set(doc.open);
    state.selected = -1;
    refresh(false);
  });
  document.getElementById("title").textContent = doc.title;

  /* #open=PATH,PATH&select=PATH&color=KEY: open those scopes (and what encloses them),
     select one, colour by KEY. */
  function fromHash() {
    var params = new URLSearchParams(location.hash.replace(/^#/, ""));
    var colour = params.get("color");
    if (colour && doc.keys[colour]) state.colorBy = select.value = colour;
    (params.get("open") || "").split(",").filter(Boolean).forEach(function (text) {
      var entry = entryOfPath(text);
      if (entry < 0) return;
      for (var e = entry; e > 0; e = T.parent[e]) state.open.add(e);
    });
    var chosen = params.get("select");
    return chosen ? entryOfPath(chosen) : -1;
  }

  var chosen = fromHash();
  refresh(false);
  if (chosen >= 0) reveal(chosen);
  window.addEventListener("hashchange", function () {
    var entry = fromHash();
    refresh(true);
    if (entry >= 0) reveal(entry);
  });
})();
