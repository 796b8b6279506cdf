"""The rendered book, read in a real browser: build the site with Jupyter Book, serve it on localhost, open the
Squash chapter in headless Chromium, and check what a reader sees (typeset math, the figure, the Colab link).
Without Chromium the browser tests skip, saying so, except under CI (CI=true), where they fail."""
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "nbs/01_squash"
COLAB = "https://colab.research.google.com/github/capsule-book/capsule_book/blob/main/nbs/01_squash.ipynb"


@pytest.fixture(scope="session")
def chromium() -> str:
    "The headless browser's path. Missing: a failure under CI (CI=true), else the browser tests skip, saying why."
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    reason = ("Chromium is needed to open the built site and is not installed: `apt-get install -y chromium` on "
              "Debian (.ci/run installs it)")
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    print(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def site():
    "Build the book into a temporary folder; yields (html folder, build log)."
    out = Path(tempfile.mkdtemp(prefix="capsule_book_site_"))
    jb = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jb) if jb.exists() else "jupyter-book", "build", str(ROOT), "--path-output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"jupyter-book build failed:\n{log[-5000:]}"
    yield out / "_build" / "html", log
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def server(site):
    "Serve the built site on 127.0.0.1 at a free port; yields its base URL."
    html, _ = site
    handler = functools.partial(_QuietHandler, directory=str(html))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _rendered_dom(chromium: str, url: str) -> str:
    "The DOM after scripts ran, as headless Chromium leaves it."
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
               f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--run-all-compositor-stages-before-draw",
               "--dump-dom", url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "<html" in proc.stdout, f"chromium failed: {proc.stderr[-2000:]}"
    return proc.stdout


class _Text(HTMLParser):
    "Visible prose of the article, leaving out code, scripts, styles and what MathJax rendered."
    SKIP = {"script", "style", "mjx-container", "mjx-assistive-mml", "noscript", "pre", "code"}

    def __init__(self):
        super().__init__()
        self.depth, self.parts = 0, []

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)


@pytest.fixture(scope="session")
def squash_dom(chromium, server):
    return _rendered_dom(chromium, f"{server}/{CHAPTER}.html")


def test_build_has_no_warnings(site):
    _, log = site
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert not warnings, "jupyter-book build warned:\n" + "\n".join(warnings)


def test_mathjax_is_served_offline(site, squash_dom):
    html, _ = site
    assert (html / "_static" / "mathjax" / "tex-chtml.js").is_file()
    src = re.findall(r'<script[^>]+src="([^"]*mathjax[^"]*)"', squash_dom)
    assert src and all(not s.startswith("http") for s in src), f"MathJax must load from the site, not a CDN: {src}"


def test_math_is_typeset(squash_dom):
    typeset = squash_dom.count("<mjx-container")
    assert typeset >= 10, f"only {typeset} typeset math elements on the Squash page"
    assert 'display="true"' in squash_dom, "no display equation was typeset"
    article = squash_dom[squash_dom.find("<article"):squash_dom.rfind("</article>")]
    parser = _Text()
    parser.feed(article)
    text = "".join(parser.parts)
    for raw in ("$$", "\\[", "\\frac", "\\|\\mathbf"):
        assert raw not in text, f"raw TeX {raw!r} left untypeset on the page"


def test_figure_is_shown(site, squash_dom):
    html, _ = site
    imgs = re.findall(r'<img[^>]+src="([^"]+\.png)"', squash_dom)
    assert imgs, "the Squash page shows no figure"
    page_dir = (html / CHAPTER).parent
    for src in imgs:
        f = (page_dir / src).resolve()
        assert f.is_file() and f.stat().st_size > 5000, f"figure {src} is missing or empty"


def test_colab_link_opens_the_chapter(squash_dom):
    links = set(re.findall(r'href="(https://colab\.research\.google\.com/[^"]+)"', squash_dom))
    assert links == {COLAB}, f"Colab links on the Squash page: {links}"


def _chapters() -> list[str]:
    "Every page of the table of contents: the root and each `file:` entry of _toc.yml."
    toc = (ROOT / "_toc.yml").read_text()
    return re.findall(r"^root:\s*(\S+)", toc, re.M) + re.findall(r"file:\s*(\S+)", toc)


def test_every_chapter_typesets_its_math_without_errors(chromium, server):
    "MathJax reports a TeX error (a \\tag inside a split, an unknown macro) as an mjx-merror element, not in the log."
    pages = _chapters()
    assert len(pages) >= 14 and "nbs/94_fourier_conv" in pages
    problems = []
    for page in pages:
        dom = _rendered_dom(chromium, f"{server}/{page}.html")
        if "<mjx-merror" in dom or "data-mjx-error" in dom:
            problems.append(f"{page}: " + "; ".join(set(re.findall(r'data-mjx-error="([^"]*)"', dom))))
        article = dom[dom.find("<article"):dom.rfind("</article>")]
        parser = _Text()
        parser.feed(article)
        text = "".join(parser.parts)
        if "$$" in text or "\\frac" in text:
            problems.append(f"{page}: raw TeX left in the prose")
    assert not problems, "\n".join(problems)
