"""`fed dashboard` in a real headless Chromium against a real run: the page loads, shows every participant and the
curves, and updates by itself as the run advances; a screenshot is saved as reports/dashboard.png."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fed.dashboard import Dashboard, status_source
from shared.digest import digest_file
from shared.state import Phase
from tests.e2e.browser import Browser, chromium
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPORTS = Path(__file__).resolve().parents[2] / "reports"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    b = Browser(chromium())
    try:
        yield b
    finally:
        b.close()


def test_the_dashboard_shows_the_fleet_and_the_curves_and_follows_the_run(
    local_run: Callable[..., Run], browser: Browser
) -> None:
    # Given a run of three participants, and its dashboard
    config = e2e_config(total_rounds=6, local_epochs=3)
    run = local_run(config)
    names = ["p1", "p2", "p3"]
    board = Dashboard(status_source(run.stack.connection), port=0, interval=0.5, title="fed: run e2e").start()
    try:
        run.start_participants(names)
        # When the page is open in the browser
        page = browser.open(board.url)

        # Then it shows every participant of the run, with its state, condition and host
        rows = page.wait_for(
            "(() => { const r = [...document.querySelectorAll('#fleet tbody tr')].map(tr => tr.dataset.pid);"
            " return r.length === 3 ? r : null; })()", 90, "a row per participant")
        assert sorted(rows) == names
        # and, once rounds are aggregated, the loss and accuracy curves
        page.wait_for("Number(document.getElementById('curve-loss').dataset.points) >= 1 && "
                      "Number(document.getElementById('curve-accuracy').dataset.points) >= 1", 120, "the curves")
        first = page.evaluate("[Number(document.getElementById('round').textContent), "
                              "Number(document.getElementById('curve-loss').dataset.points), "
                              "Number(document.body.dataset.refreshes)]")
        # and, without being reloaded, it follows the run as it advances
        page.wait_for(f"Number(document.getElementById('curve-loss').dataset.points) > {first[1]} && "
                      f"Number(document.getElementById('round').textContent) > {first[0]}", 120,
                      "the page to show a later round")
        run.wait_for(lambda: run.state().phase is Phase.FINISHED, 150, "the run to finish")
        page.wait_for("document.getElementById('phase').textContent === 'Finished'", 30, "the page to show the end")
        page.wait_for("!!document.getElementById('result-digest')", 30, "the page to show the result")
        shown = page.evaluate(
            "({points: Number(document.getElementById('curve-loss').dataset.points),"
            " refreshes: Number(document.body.dataset.refreshes),"
            " cells: [...document.querySelectorAll('#fleet tbody tr')].map(tr =>"
            "   [...tr.children].map(td => td.textContent)),"
            " aggregated: document.getElementById('aggregated').textContent,"
            " polyline: !!document.querySelector('#curve-accuracy polyline'),"
            " key: document.getElementById('result-key').textContent,"
            " digest: document.getElementById('result-digest').textContent,"
            " fetch: document.getElementById('result-fetch').textContent,"
            " accuracyFrom: Number(document.getElementById('curve-accuracy').dataset.axisFrom),"
            " accuracyLast: document.getElementById('curve-accuracy').dataset.lastValue})")
        assert shown["points"] == 6 and shown["aggregated"] == "6/6" and shown["polyline"]
        assert shown["refreshes"] > first[2]
        # and every participant finished (not silent: they exited as designed), none with a refusal
        for cells in shown["cells"]:
            pid, state, condition = cells[0], cells[1], cells[2]
            assert pid in names and (state, condition) == ("finished", "finished") and cells[8], cells
            assert cells[9].startswith("last trained round") and cells[10] == "", cells  # why; drops and refusals
        # and where the result is: the final global's key and digest, and the command that fetches it
        state = run.state()
        assert shown["digest"] == state.global_digest and shown["key"].endswith(f"/global/{state.global_digest}")
        assert shown["fetch"].startswith(f"fed export --round {state.round}")
        # and the accuracy axis starts near the data, its last value labelled
        assert shown["accuracyFrom"] > 0.5 and float(shown["accuracyLast"]) > 0.5
        # and `fed status --json` says the same
        code, out = run.fed("status", "--json")
        assert code == 0, out
        status = json.loads(out)
        assert {(p["pid"], p["state"], p["condition"]) for p in status["participants"]} == {
            (n, "finished", "finished") for n in names}
        assert status["refusals"] == [] and all(not p["refusals"] for p in status["participants"])
        assert (status["result"]["key"], status["result"]["digest"]) == (shown["key"], shown["digest"])
        # and the command shown fetches it, checked against its digest
        code, out = run.fed("export", "--round", "latest", str(run.workdir / "final.safetensors"))
        assert code == 0, out
        assert digest_file(run.workdir / "final.safetensors") == state.global_digest
        # and a screenshot of it is kept
        shot = page.screenshot(REPORTS / "dashboard.png")
        assert shot.stat().st_size > 10_000
        (REPORTS / "dashboard.json").write_text(json.dumps(shown, indent=1))
    finally:
        board.stop()
