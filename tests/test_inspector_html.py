"""The HTML page: self-contained (no network, no server), loads in headless Chromium without
console errors, and shows a picture after one box is opened (a screenshot that is not blank).

Chromium runs with --dump-dom and --screenshot only: it opens no port, its profile lives in the
test's temporary directory, and its whole process group is killed however the test ends."""

import json
import os
import re
import shutil
import signal
import struct
import subprocess
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
