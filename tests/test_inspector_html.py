"""The HTML page: self-contained (no network, no server), loads in headless Chromium without
console errors, shows a picture after one box is opened (a screenshot that is not blank), and
answers clicks, searches and the colour switch.

Chromium runs with --dump-dom, --screenshot or --remote-debugging-pipe (DevTools over its fds
3 and 4): it opens no port, its profile lives in the test's temporary directory, every wait is
bounded, and its whole process group is killed however the test ends."""

import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import time
import zlib

import numpy as np
import pytest
from conftest import fixture_path

from graphxform import metagraph, strategies
from graphxform.inspector import html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                                    reason="needs Chromium (apt-get install chromium)")
WINDOW = (1200, 800)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    ir = metagraph.load(fixture_path("cnn_bn_momentum"))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    path = tmp_path_factory.mktemp("html") / "cnn.html"
    path.write_text(html.page(ir))
    return path


def data_of(text: str) -> dict:
    found = re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', text,
                      re.S)
    return json.loads(found.group(1))


def test_page_is_self_contained(page):
    text = page.read_text()
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text)  # only the SVG namespace
    doc = data_of(text)
    parents = doc["tree"]["parent"]
    assert parents[0] == -1 and all(parents[k] < k for k in range(1, len(parents)))
    assert len(doc["leaves"]["op"]) == len(doc["leaves"]["inputs"]) == len(doc["keys"]["pass"])
    assert set(doc["keys"]) == {"device", "replica", "pass"}
    assert "replicate" in doc["tables"]["pass"]


def test_names_cannot_end_the_script(tmp_path):
    ir = metagraph.load(fixture_path("mlp_sgd"))
    text = html.page(ir, title="a </script><b>title</b>")
    assert text.count("</script>") == 2 and "&lt;/script&gt;" in text
    assert data_of(text)["title"] == "a </script><b>title</b>"


def run_chromium(tmp_path, *args, timeout=90):
    """Run headless Chromium in its own process group; returns (stdout, stderr)."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-extensions", "--disable-background-networking", "--disable-sync",
               "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
               f"--user-data-dir={tmp_path / 'profile'}",
               f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=5000", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    return out, err


def console_messages(stderr: str) -> list:
    return [line for line in stderr.splitlines() if "CONSOLE" in line]


def png_pixels(path) -> np.ndarray:
    """The pixels of an 8-bit, non-interlaced RGB(A) PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat, header = 8, b"", None
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), dtype=np.int32)
    prior = np.zeros(width * bpp, dtype=np.int32)
    for y in range(height):
        kind, row = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            line = row
        elif kind == 2:
            line = (row + prior) % 256
        elif kind == 1:
            line = np.cumsum(row.reshape(width, bpp), axis=0).reshape(-1) % 256
        else:
            line = np.zeros_like(row)
            for x in range(width * bpp):
                left = line[x - bpp] if x >= bpp else 0
                up, corner = prior[x], prior[x - bpp] if x >= bpp else 0
                if kind == 3:
                    guess = (left + up) // 2
                else:
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    guess = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[x] = (row[x] + guess) % 256
        out[y] = line
        prior = line
    return out.reshape(height, width, bpp)[:, :, :3]


@pytest.mark.slow
@needs_chromium
def test_page_loads_without_console_errors(page, tmp_path):
    out, err = run_chromium(tmp_path, "--dump-dom", page.as_uri())
    body = re.search(r"<body[^>]*>", out).group(0)
    assert 'data-ready="1"' in body and "data-errors" not in body, body
    assert int(re.search(r'data-boxes="(\d+)"', body).group(1)) > 5
    assert console_messages(err) == []


@pytest.mark.slow
@needs_chromium
def test_screenshot_after_opening_a_box_is_not_blank(page, tmp_path):
    shot = tmp_path / "shot.png"
    opened = page.as_uri() + "#open=replica_0/bn0&select=replica_0/bn0/batchnorm/mul"
    out, err = run_chromium(tmp_path, f"--screenshot={shot}", opened)
    assert shot.exists(), err[-2000:]
    assert console_messages(err) == []
    pixels = png_pixels(shot)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    canvas = pixels[60:, :-360]  # below the toolbar, left of the side panel
    not_white = (canvas < 235).any(axis=2).mean()
    colours = len(np.unique(canvas.reshape(-1, 3), axis=0))
    assert not_white > 0.01 and colours > 20, (not_white, colours)
    dom, _ = run_chromium(tmp_path, "--dump-dom", opened)
    assert "replica_*/bn0/batchnorm/mul" in dom  # the side panel shows the selected op


class DevTools:
    """Headless Chromium driven over --remote-debugging-pipe: NUL-terminated JSON messages,
    commands on its fd 3, replies on its fd 4."""

    def __init__(self, tmp_path, url):
        commands_read, self.commands = os.pipe()
        self.replies, replies_write = os.pipe()

        def plumb():
            os.dup2(commands_read, 3)
            os.dup2(replies_write, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-pipe", f"--user-data-dir={tmp_path / 'devtools'}",
             f"--window-size={WINDOW[0]},{WINDOW[1]}", url],
            pass_fds=(3, 4), preexec_fn=plumb, start_new_session=True,  # kept after plumb
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_read)
        os.close(replies_write)
        self.buffer, self.next_id = b"", 0
        page = next(t for t in self.call("Target.getTargets")["targetInfos"]
                    if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"],
                                 flatten=True)["sessionId"]

    def call(self, method, timeout=30, session=None, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    assert "error" not in reply, reply
                    return reply["result"]
            left = deadline - time.monotonic()
            assert left > 0, f"no reply to {method} in {timeout} s"
            if select.select([self.replies], [], [], left)[0]:
                chunk = os.read(self.replies, 1 << 16)
                assert chunk, "Chromium closed DevTools"
                self.buffer += chunk

    def evaluate(self, expression, timeout=30):
        result = self.call("Runtime.evaluate", timeout, session=self.session,
                           expression=expression, awaitPromise=True, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_loaded(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.evaluate("document.body && document.body.dataset.ready") == "1":
                    return
            except AssertionError:  # the context of about:blank went away: the page loads
                pass
            time.sleep(0.1)
        raise AssertionError("the page never got ready")

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        os.close(self.commands)
        os.close(self.replies)


INTERACT = """(async () => {
  const sleep = ms => new Promise(done => setTimeout(done, ms));
  const before = Number(document.body.dataset.boxes);
  const box = document.querySelector(".box.scope");
  const entry = box.dataset.entry, r = box.getBoundingClientRect();
  const at = {clientX: r.x + 5, clientY: r.y + 5, bubbles: true};
  box.dispatchEvent(new PointerEvent("pointerdown", at));
  box.dispatchEvent(new PointerEvent("pointerup", at));
  await sleep(100);
  const opened = !document.querySelector(`.box[data-entry="${entry}"]`);
  const after = Number(document.body.dataset.boxes);
  const search = document.getElementById("search");
  search.value = "MatMul";
  search.dispatchEvent(new Event("input"));
  await sleep(400);
  const results = Array.from(document.querySelectorAll("#results a")).map(a => a.textContent);
  const colour = document.getElementById("color");
  colour.value = "pass";
  colour.dispatchEvent(new Event("change"));
  await sleep(50);
  return {before, after, opened, results,
          legend: document.querySelector("#legend h3").textContent,
          errors: document.body.dataset.errors || "0"};
})()"""


@pytest.mark.slow
@needs_chromium
def test_clicks_search_and_colour_switch(page, tmp_path):
    chrome = DevTools(tmp_path, page.as_uri())
    try:
        chrome.wait_loaded()
        done = chrome.evaluate(INTERACT)
    finally:
        chrome.close()
    assert done["opened"] and done["after"] > done["before"] - 1, done
    assert done["results"] and all("matmul" in r.lower() for r in done["results"])
    assert done["legend"] == "colour: pass" and done["errors"] == "0"
