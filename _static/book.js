/* capsule_book: how a chapter reads in the browser.
 *
 * 1. Tooling a reader should not see: progress-bar lines (tqdm) are taken out of printed outputs. (nbdev's
 *    directives, `#| export` and the like, never reach the page: _ext/nbdev_directives.py takes them out when the
 *    book is built.) Each line of code becomes its own span, so that a long line wraps under itself.
 * 2. labml's layout (nn.labml.ai): each code cell is paired with the markdown blocks right before it (back to the
 *    previous code cell or heading) in a <div class="nb-pair"> holding <div class="nb-notes"> and
 *    <div class="nb-code">. A chapter's introduction is not paired; notes that hold an image, a table, a figure or
 *    display math wider than their column make the pair "wide": notes across the page, code below. book.css lays a pair out as two columns (notes left, code right, tops aligned) on a
 *    window at least 1200 px wide, and as one column below that. Headings stay outside the pairs, full width.
 *
 * It runs once, when the DOM is parsed; it only moves nodes, so MathJax, search highlighting and the copy buttons
 * keep working on the same elements.
 */
(function () {
  "use strict";

  var PROGRESS = /\d+%\|.*\|\s*\d+(\.\d+)?[kMG]?\/\d+(\.\d+)?[kMG]?\s*\[|\d+(\.\d+)?(it\/s|s\/it)[,\]]/;
  var HEADING = /^H[1-6]$/;

  function isCell(el) {
    return el.nodeType === 1 && el.classList.contains("cell") && el.tagName === "DIV";
  }

  /* Split a highlighted <pre> into one <span class="nb-line"> per source line, copying the token spans a line
   * runs through, so that each line can be dropped or wrapped with a hanging indent on its own. */
  function splitLines(pre) {
    var lines = [], current = [], walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT, null), node;
    function wrap(text, textNode) {
      var piece = document.createTextNode(text), el = textNode.parentNode;
      while (el && el !== pre) {
        var copy = el.cloneNode(false);
        copy.removeAttribute("id");
        copy.appendChild(piece);
        piece = copy;
        el = el.parentNode;
      }
      return piece;
    }
    while ((node = walker.nextNode())) {
      var parts = node.nodeValue.split("\n");
      for (var k = 0; k < parts.length; k++) {
        if (k > 0) {
          lines.push(current);
          current = [];
        }
        if (parts[k]) current.push(wrap(parts[k], node));
      }
    }
    if (current.length) lines.push(current);
    return lines.map(function (pieces) {
      var span = document.createElement("span");
      span.className = "nb-line";
      pieces.forEach(function (p) { span.appendChild(p); });
      return span;
    });
  }

  /* One <span class="nb-line"> per line of a code cell, each with its indentation as --nb-indent (book.css wraps a
   * long line under itself with a hanging indent). */
  function lineSpans(cell) {
    var pre = cell.querySelector(":scope > .cell_input pre");
    if (!pre) return;
    var lines = splitLines(pre);
    while (pre.firstChild) pre.removeChild(pre.firstChild);
    lines.forEach(function (line) {
      var indent = /^ */.exec(line.textContent)[0].length;
      line.style.setProperty("--nb-indent", indent + 4 + "ch");
      pre.appendChild(line);
      pre.appendChild(document.createTextNode("\n"));
    });
  }

  /* Printed progress bars: drop the lines that look like tqdm's, and the output if nothing else is left. */
  function stripProgress(cell) {
    cell.querySelectorAll(":scope > .cell_output .output.stream, :scope > .cell_output .output.stderr").forEach(function (out) {
      var pre = out.querySelector("pre");
      if (!pre || !PROGRESS.test(pre.textContent)) return;
      var kept = pre.textContent.split(/\r\n|\r|\n/).filter(function (l) { return l.trim() && !PROGRESS.test(l); });
      if (kept.length) pre.textContent = kept.join("\n") + "\n";
      else out.parentNode.removeChild(out);
    });
    var output = cell.querySelector(":scope > .cell_output");
    if (output && !output.children.length) output.parentNode.removeChild(output);
  }

  var MEDIA = "img, svg, table, figure, video, div.highlight";

  function pair(cell) {
    if (!cell.querySelector(":scope > .cell_input")) return;   // an output shown without its code stays full width
    var notes = [], prev = cell.previousElementSibling;
    while (prev && !isCell(prev) && !HEADING.test(prev.tagName) && prev.tagName !== "SECTION" &&
           !prev.classList.contains("nb-pair")) {
      notes.unshift(prev);
      prev = prev.previousElementSibling;
    }
    // A chapter's introduction (the notes right under its title) is read on its own, not beside the first code cell.
    if (notes.length && prev && prev.tagName === "H1") return;
    var box = document.createElement("div"), left = document.createElement("div"), right = document.createElement("div");
    box.className = "nb-pair" + (notes.length ? "" : " nb-pair--code-only");
    // Notes that hold an image, a table or a figure take the full width, with their code below them.
    if (notes.some(function (n) { return n.matches(MEDIA) || n.querySelector(MEDIA); })) box.classList.add("nb-pair--wide");
    left.className = "nb-notes";
    right.className = "nb-code";
    cell.parentNode.insertBefore(box, notes.length ? notes[0] : cell);
    notes.forEach(function (n) { left.appendChild(n); });
    right.appendChild(cell);
    box.appendChild(left);
    box.appendChild(right);
  }

  /* Display math wider than its notes column: once MathJax has typeset it, the pair takes the full width too. */
  function widenForMath() {
    document.querySelectorAll(".nb-pair:not(.nb-pair--wide) > .nb-notes").forEach(function (notes) {
      var wide = Array.prototype.some.call(notes.querySelectorAll('mjx-container[display="true"]'), function (m) {
        return m.scrollWidth > m.clientWidth + 1;
      });
      if (wide) notes.parentNode.classList.add("nb-pair--wide");
    });
  }

  function whenTypeset(callback, tries) {
    var mj = window.MathJax;
    tries = tries || 0;
    if (mj && mj.startup && mj.startup.promise) mj.startup.promise.then(callback);
    else if (tries < 100) setTimeout(function () { whenTypeset(callback, tries + 1); }, 100);
  }

  /* The page's table of contents: on a wide window the paired layout needs its column, so it opens from the
   * article header's "contents" button instead, as a panel. */
  function tocButton() {
    var button = document.querySelector(".bd-header-article .secondary-toggle");
    if (!button) return;
    button.addEventListener("click", function (e) {
      if (!window.matchMedia("(min-width: 1200px)").matches) return;
      e.preventDefault();
      e.stopImmediatePropagation();
      document.body.classList.toggle("nb-toc-open");
    }, true);
    document.addEventListener("click", function (e) {
      if (!document.body.classList.contains("nb-toc-open")) return;
      if (e.target.closest(".bd-header-article .secondary-toggle")) return;
      if (!e.target.closest(".bd-sidebar-secondary") || e.target.closest("a")) document.body.classList.remove("nb-toc-open");
    });
    document.addEventListener("keydown", function (e) {
      if (e.key === "Escape") document.body.classList.remove("nb-toc-open");
    });
  }

  /* The theme binds its sidebar toggles to the first such button in the page, the one in the header bar that
   * book.css hides (sphinx-book-theme 1.3 with pydata-sphinx-theme 0.17), so the article header's own buttons did
   * nothing; they pass their click on to it. */
  function forwardToggle(kind, unlessWide) {
    var mine = document.querySelector(".bd-header-article ." + kind), theirs = document.querySelector("." + kind);
    if (!mine || !theirs || mine === theirs) return;
    mine.addEventListener("click", function (e) {
      if (unlessWide && document.body.classList.contains("nb-paired") &&
          window.matchMedia("(min-width: 1200px)").matches) return;
      e.preventDefault();
      theirs.click();
    });
  }

  function run() {
    forwardToggle("primary-toggle", false);
    forwardToggle("secondary-toggle", true);
    var article = document.querySelector("article.bd-article");
    if (!article) return;
    var cells = Array.prototype.slice.call(article.querySelectorAll("div.cell"));
    cells.forEach(function (cell) {
      lineSpans(cell);
      stripProgress(cell);
      if (!cell.children.length) cell.parentNode.removeChild(cell);
    });
    cells.forEach(function (cell) {
      if (cell.parentNode) pair(cell);
    });
    if (article.querySelector(".nb-pair")) {
      document.body.classList.add("nb-paired");
      tocButton();
      whenTypeset(widenForMath);
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", run);
  else run();
})();
