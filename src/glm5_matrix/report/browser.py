"""report.html in real headless Chromium: it loads without a console error and without a
request for anything but itself, every cell and every test of the results is on it with its
outcome as text, its one control works, and a screenshot lands beside it.

Chromium is driven through the DevTools protocol over a pipe (--remote-debugging-pipe: JSON
messages separated by NUL on file descriptors 3 and 4), so no port is opened. Each run gets a
fresh profile folder; the browser is stopped (and killed if it does not stop) whatever happens.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_atomic

CHROMIUM_VARIABLE = "GLM5_MATRIX_CHROMIUM"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "Debian's chromium package: apt-get install -y chromium"
# The machine's network is closed, and the page must not need it: Chromium's own traffic off.
FLAGS = (
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--mute-audio",
    "--disable-breakpad",
    "--disable-crash-reporter",
    "--remote-debugging-pipe",
)
VIEWPORT = {"width": 1280, "height": 1000, "deviceScaleFactor": 1, "mobile": False}


def find_chromium(environ: dict[str, str] | None = None) -> str | None:
    environ = dict(os.environ) if environ is None else environ
    given = environ.get(CHROMIUM_VARIABLE)
    if given:
        return given if os.access(given, os.X_OK) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class DevTools:
    """A headless Chromium and one page, spoken to over --remote-debugging-pipe."""

    def __init__(self, executable: str, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="glm5-chromium-")
        # Chromium's own log (it complains about D-Bus on a bare machine): a file, never a pipe
        # that could fill up and block it.
        self._log = open(Path(self.profile) / "chromium.log", "wb")  # noqa: SIM115
        self.events: list[dict[str, Any]] = []
        self._next_id = 0
        self._buffer = b""
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # Chromium reads fd 3 and writes fd 4: a small trampoline moves the pipe ends there
        # (from numbers >= 10, so that the two moves cannot overwrite each other) and execs it.
        high_r = _dup_high(to_chrome_r)
        high_w = _dup_high(from_chrome_w)
        for fd in (to_chrome_r, from_chrome_w):
            os.close(fd)
        flags = [*FLAGS, f"--user-data-dir={self.profile}"]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        trampoline = (
            "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
            "os.close(int(sys.argv[1])); os.close(int(sys.argv[2])); "
            "os.execv(sys.argv[3], sys.argv[3:])"
        )
        command = [sys.executable, "-c", trampoline, str(high_r), str(high_w), executable, *flags]
        self.process = subprocess.Popen(
            command,
            pass_fds=(high_r, high_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,
        )
        os.close(high_r)
        os.close(high_w)
        self.session: str | None = None

    def __enter__(self) -> DevTools:
        try:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            attached = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
            self.session = attached["sessionId"]
            for domain in ("Runtime", "Log", "Network", "Page"):
                self.call(f"{domain}.enable")
            self.call("Emulation.setDeviceMetricsOverride", VIEWPORT)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result") or {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        deadline = time.monotonic() + self.timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} from Chromium within {self.timeout:.0f} s")
            event = self._receive()
            self.events.append(event)
            if event.get("method") == method:
                return event

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def _receive(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_chrome], [], [], max(left, 0))
            if not ready:
                raise TimeoutError(f"Chromium sent nothing for {self.timeout:.0f} s")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited: {self._stderr_tail()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(message))

    def _stderr_tail(self) -> str:
        self._log.flush()
        text = (Path(self.profile) / "chromium.log").read_bytes().decode(errors="replace")
        lines = [line for line in text.splitlines() if "dbus" not in line]
        return "\n".join(lines[-20:])

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                try:
                    os.write(
                        self._to_chrome,
                        json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0",
                    )
                    self.process.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            # Its own session: whatever is left of it (helpers, or a browser that did not
            # close) goes too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 9)
            self.process.wait(timeout=10)
        finally:
            for fd in (self._to_chrome, self._from_chrome):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._log.close()
            shutil.rmtree(self.profile, ignore_errors=True)


def _dup_high(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, 10)


# What the first screen (VIEWPORT, scrolled to the top) shows: where the verdict, the headline
# and the first failure (or "No failures.") end, in CSS pixels from the top.
_FIRST_SCREEN = """(() => {
  window.scrollTo(0, 0);
  const bottom = (el) => (el ? el.getBoundingClientRect().bottom : null);
  const top = (el) => (el ? el.getBoundingClientRect().top : null);
  const first = document.querySelector("#failures .failure");
  return {
    height: window.innerHeight, width: window.innerWidth,
    verdict: bottom(document.getElementById("verdict")),
    verdict_text: document.getElementById("verdict") ?
      document.getElementById("verdict").innerText.trim() : null,
    headline: bottom(document.getElementById("headline")),
    failure_top: top(first),
    failure_why: first ? bottom(first.querySelector(".why") || first) : null,
    no_failures: bottom(document.getElementById("no-failures")),
    page: document.documentElement.scrollHeight,
  };
})()"""
# Each collapsed section (a suite file's tests, the cells not run): its content takes no room
# while closed, and shows once its summary is clicked; closed again after.
_COLLAPSED = """(() => {
  const sections = [...document.querySelectorAll("details.suite, details#not-run")];
  return sections.filter((d) => !d.open).map((d) => {
    const content = d.querySelector("table");
    const height = () => d.getBoundingClientRect().height;
    const closed = height(), hidden = !content.checkVisibility();
    d.querySelector("summary").click();
    const grew = height() - closed, shown = content.checkVisibility(), opened = d.open;
    d.querySelector("summary").click();
    return { name: d.dataset.file || d.id, hidden: hidden, shown: shown, grew: grew,
             opened: opened, closed_again: !d.open && height() === closed };
  });
})()"""
# Every comparison chart as Chromium laid it out: the screen x of the tolerance, the control
# bar, the noise band's ends and each mark's centre, with what each stands for.
_CHARTS = """(() => [...document.querySelectorAll("#comparisons svg.comparison")].map((svg) => {
  const box = (el) => el.getBoundingClientRect();
  const centre = (el) => { const b = box(el); return b.left + b.width / 2; };
  const line = svg.querySelector("line.tolerance"), bar = svg.querySelector("line.bar");
  const noise = svg.querySelector("rect.noise");
  return {
    cell: svg.dataset.cell, name: svg.dataset.name,
    width: box(svg).width, height: box(svg).height,
    tolerance: line ? centre(line) : null, bar: bar ? centre(bar) : null,
    noise_left: noise ? box(noise).left : null, noise_right: noise ? box(noise).right : null,
    runs: [...svg.querySelectorAll("circle.run")].map((c) => ({
      label: c.dataset.label, value: Number(c.dataset.value), judged: c.dataset.judged === "true",
      x: centre(c), width: box(c).width })),
    controls: [...svg.querySelectorAll("path.control")].map((c) => ({
      label: c.dataset.label, value: c.dataset.value, x: centre(c), width: box(c).width })),
  };
}))()"""
# What the page shows, read in the page itself (the grid cells' text is what a person sees),
# with every collapsed section opened for the reading and closed again after.
_PAGE_FACTS = """(() => {
  const closed = [...document.querySelectorAll("details")].filter((d) => !d.open);
  closed.forEach((d) => { d.open = true; });
  const text = (el) => (el ? el.innerText.trim() : null);
  const facts = {
    headline: text(document.getElementById("headline")),
    cells: [...document.querySelectorAll("table.cells tr[data-cell]")].map((row) => ({
      id: row.dataset.cell, text: text(row),
      status: text(row.querySelector("[data-status]")),
    })),
    grid: [...document.querySelectorAll("tr[data-test]")].flatMap((row) =>
      [...row.querySelectorAll("td[data-cell]")].map((td) => ({
        test: row.dataset.test, name: text(row.querySelector("th")),
        cell: td.dataset.cell, outcome: td.dataset.outcome || null, text: text(td),
      }))),
    failures: [...document.querySelectorAll("details.failure-text")].map((d) => ({
      cell: d.dataset.cell, test: d.dataset.test, summary: text(d.querySelector("summary")),
    })),
    rows: document.querySelectorAll("tr[data-test]").length,
  };
  closed.forEach((d) => { d.open = false; });
  return facts;
})()"""
_FILTER = """(() => {
  const box = document.getElementById("only-problems");
  box.checked = true; box.dispatchEvent(new Event("change"));
  const shown = [...document.querySelectorAll("tr[data-test]")]
    .filter((row) => !row.classList.contains("hidden")).map((row) => row.dataset.test);
  box.checked = false; box.dispatchEvent(new Event("change"));
  return shown;
})()"""


@dataclass
class PageLoad:
    """What Chromium saw while loading a page."""

    url: str
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, log errors
    requests: list[str] = field(default_factory=list)  # anything fetched but the page itself
    facts: dict[str, Any] = field(default_factory=dict)
    filtered: list[str] = field(default_factory=list)  # rows left by "only failed" filter
    first_screen: dict[str, Any] = field(default_factory=dict)
    collapsed: list[dict[str, Any]] = field(default_factory=list)  # each closed section, tried
    charts: list[dict[str, Any]] = field(default_factory=list)
    screenshot: Path | None = None


def load_page(
    page: Path, screenshot: Path | None = None, executable: str | None = None
) -> PageLoad:
    executable = executable or find_chromium()
    if executable is None:
        raise UserError(f"Chromium not found (set {CHROMIUM_VARIABLE}, or install {INSTALL_HINT})")
    url = page.resolve().as_uri()
    loaded = PageLoad(url)
    with DevTools(executable) as tools:
        tools.call("Page.navigate", {"url": url})
        tools.wait_for("Page.loadEventFired")
        loaded.first_screen = tools.evaluate(_FIRST_SCREEN)
        loaded.charts = tools.evaluate(_CHARTS)
        loaded.collapsed = tools.evaluate(_COLLAPSED)
        loaded.facts = tools.evaluate(_PAGE_FACTS)
        loaded.filtered = tools.evaluate(_FILTER)
        if screenshot is not None:
            shot = tools.call(
                "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
            )
            write_atomic(screenshot, base64.b64decode(shot["data"]))
            loaded.screenshot = screenshot
        events = list(tools.events)
    for event in events:
        method, params = event.get("method"), event.get("params") or {}
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails") or {}
            exception = details.get("exception") or {}
            loaded.errors.append(
                f"exception: {exception.get('description') or details.get('text')}"
            )
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(
                str(a.get("value", a.get("description", ""))) for a in params.get("args", [])
            )
            loaded.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and (params.get("entry") or {}).get("level") == "error":
            entry = params["entry"]
            loaded.errors.append(
                f"{entry.get('source')}: {entry.get('text')} {entry.get('url') or ''}".strip()
            )
        elif method == "Network.requestWillBeSent":
            requested = (params.get("request") or {}).get("url", "")
            if requested != url and not requested.startswith("data:"):
                loaded.requests.append(requested)
    return loaded


@dataclass
class ReportCheck:
    load: PageLoad
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        facts = self.load.facts
        seen = (
            f"{len(facts.get('cells', []))} cells, {facts.get('rows', 0)} test rows in "
            f"{len(self.load.collapsed)} collapsed sections, {len(self.load.charts)} comparison "
            f"charts, {self.load.first_screen.get('page')} px tall"
        )
        shot = f"; screenshot {self.load.screenshot}" if self.load.screenshot else ""
        if self.ok:
            return f"Chromium: report.html loads cleanly ({seen}){shot}"
        shown = "; ".join(self.problems[:10])
        more = f" (and {len(self.problems) - 10} more)" if len(self.problems) > 10 else ""
        return f"Chromium: report.html has {len(self.problems)} problem(s): {shown}{more}{shot}"


def check_report(page: Path, report: Any, screenshot: Path | None = None) -> ReportCheck:
    """Load `page` and hold it against `report` (a glm5_matrix.report.model.MatrixReport)."""
    from glm5_matrix.report.page import OUTCOME_WORDS

    load = load_page(page, screenshot)
    problems = [f"console: {e}" for e in load.errors]
    problems += [f"requested {r}" for r in load.requests]
    facts = load.facts
    if facts.get("headline") != report.headline():
        problems.append(f"headline {facts.get('headline')!r} != {report.headline()!r}")
    rows = {c["id"]: c for c in facts.get("cells", [])}
    for cell in report.cells:
        row = rows.get(cell.id)
        if row is None:
            problems.append(f"cell {cell.id} is not on the page")
        elif cell.id not in (row["text"] or "") or row["status"] != cell.status:
            problems.append(f"cell {cell.id}: the page shows {row['text']!r}")
    extra = set(rows) - {c.id for c in report.cells}
    problems += [f"cell {name} is on the page but not in the results" for name in sorted(extra)]
    grid = {(g["test"], g["cell"]): g for g in facts.get("grid", [])}
    for cell in report.cells:
        for test in cell.tests:
            key = (test.nodeid if test.file else test.name, cell.id)
            shown = grid.get(key)
            word = OUTCOME_WORDS.get(test.outcome, test.outcome)
            if shown is None:
                problems.append(f"{cell.id}: test {test.nodeid} is not on the page")
            elif shown["outcome"] != test.outcome or shown["text"] != word:
                problems.append(f"{cell.id}: {test.nodeid} shows {shown['text']!r}, not {word!r}")
            elif shown["name"] != test.name:
                problems.append(f"{cell.id}: {test.nodeid} is labelled {shown['name']!r}")
    failures = {(f["cell"], f["test"]) for f in facts.get("failures", [])}
    for cell in report.cells:
        for test in cell.failures:
            if (cell.id, test.nodeid) not in failures:
                problems.append(f"{cell.id}: failure {test.nodeid} cannot be expanded on the page")
    failing = {
        g["test"] for g in facts.get("grid", []) if g["outcome"] in ("failed", "error", "xpassed")
    }
    if set(load.filtered) != failing:
        problems.append(
            f"the 'only failed' filter leaves {len(load.filtered)} rows, not the {len(failing)} failing"
        )
    problems += first_screen_problems(load.first_screen, report)
    problems += collapsed_problems(load.collapsed)
    problems += chart_problems(load.charts, report)
    return ReportCheck(load, problems)


def first_screen_problems(seen: dict[str, Any], report: Any) -> list[str]:
    """The first screen (VIEWPORT at the top of the page) must show the verdict, the headline
    and the first failure's first line, or that there is none."""
    height = seen.get("height") or VIEWPORT["height"]
    problems = []
    for key, what in (("verdict", "the verdict"), ("headline", "the headline")):
        if seen.get(key) is None or seen[key] > height:
            problems.append(f"first screen: {what} ends at {seen.get(key)} px, below {height}")
    word = "PASSED" if report.ok else "FAILED"
    if report.ok and not any(c.status != "not run" for c in report.cells):
        word = "NOTHING RAN"
    if not str(seen.get("verdict_text") or "").startswith(word):
        problems.append(f"first screen: the verdict reads {seen.get('verdict_text')!r}, not {word}")
    if report.ok:
        if seen.get("no_failures") is None or seen["no_failures"] > height:
            problems.append("first screen: 'No failures.' is not on it")
    elif seen.get("failure_why") is None or seen["failure_why"] > height:
        problems.append(
            f"first screen: the first failure's line ends at {seen.get('failure_why')} px, "
            f"below {height}"
        )
    return problems


def collapsed_problems(sections: list[dict[str, Any]]) -> list[str]:
    """Each collapsed section hides its content and shows it once opened."""
    problems = []
    for section in sections:
        if not section["hidden"]:
            problems.append(f"section {section['name']} is collapsed but its table shows")
        if not (section["opened"] and section["shown"] and section["grew"] > 0):
            problems.append(f"section {section['name']} does not show its table when opened")
        if not section["closed_again"]:
            problems.append(f"section {section['name']} does not close again")
    return problems


def chart_problems(charts: list[dict[str, Any]], report: Any) -> list[str]:
    """Every judged comparison of the results is drawn, rendered (it has a size), and drawn
    right: the noise band past the tolerance exactly when its largest pair is, each judged run
    on the side of the tolerance its delta is, each control past its bar exactly when its power
    reached it."""
    problems = []
    drawn = {(c["cell"], c["name"]): c for c in charts}
    expected = {(cell.id, c.name): c for cell in report.cells for c in cell.comparisons}
    for key in sorted(set(expected) - set(drawn)):
        problems.append(f"comparison {key[1]} of {key[0]} is not drawn")
    for key in sorted(set(drawn) - set(expected)):
        problems.append(f"comparison {key[1]} of {key[0]} is drawn but not in the results")
    for key in sorted(set(expected) & set(drawn)):
        chart, comparison, where = drawn[key], expected[key], f"{key[0]} {key[1]}"
        if not (chart["width"] > 0 and chart["height"] > 0) or chart["tolerance"] is None:
            problems.append(f"chart {where} is not rendered")
            continue
        tolerance = chart["tolerance"]
        if chart["noise_right"] is not None:
            # Past the tolerance exactly when the measured noise is: a reference whose own pairs
            # reach past its tolerance (an outlying run, what the self-check reports) is drawn so.
            drawn_past = chart["noise_right"] > tolerance + 1
            noise_past = comparison.noise_max is not None and (
                comparison.noise_max > comparison.tolerance
            )
            if drawn_past != noise_past:
                problems.append(
                    f"chart {where}: the noise band "
                    f"{'reaches past' if drawn_past else 'stops short of'} the tolerance, the "
                    f"noise measured {'does not' if drawn_past else 'does'}"
                )
        labels = sorted(r.label for r in comparison.runs)
        if sorted(r["label"] for r in chart["runs"]) != labels:
            problems.append(
                f"chart {where}: runs {[r['label'] for r in chart['runs']]} != {labels}"
            )
        for run in chart["runs"]:
            if not run["width"] > 0:
                problems.append(f"chart {where}: run {run['label']} is not rendered")
            elif run["judged"] and (run["value"] <= comparison.tolerance) != (
                run["x"] <= tolerance + 1
            ):
                side = "left" if run["x"] <= tolerance + 1 else "right"
                problems.append(
                    f"chart {where}: run {run['label']} ({run['value']:g} nats, tolerance "
                    f"{comparison.tolerance:g}) is drawn {side} of the tolerance"
                )
        if len(chart["controls"]) != len(comparison.controls):
            problems.append(
                f"chart {where}: {len(chart['controls'])} controls drawn, not "
                f"{len(comparison.controls)}"
            )
        measured = {c.label: c for c in comparison.controls}
        for control in chart["controls"]:
            bar = chart["bar"] if chart["bar"] is not None else tolerance
            data = measured.get(control["label"])
            # A control is drawn past its bar exactly when its data reach it: one that fell
            # short (a NoPower failure) must be drawn short, not only one that passed drawn past.
            reaches = (
                data is None
                or data.power is None
                or data.min_power is None
                or (data.power >= data.min_power)
            )
            if not control["width"] > 0:
                problems.append(f"chart {where}: control {control['label']} is not rendered")
            elif (control["x"] >= bar - 1) != reaches:
                side = "past" if control["x"] >= bar - 1 else "short of"
                problems.append(
                    f"chart {where}: control {control['label']} is drawn {side} its bar"
                )
    return problems
