"""`fed dashboard`'s server: the page, its status endpoint (what `fed status --json` has, plus every round's
history), and its behaviour when the run cannot be read. The page in a real browser: tests/e2e/test_dashboard.py."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from fed.dashboard import Dashboard


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


@pytest.fixture
def board() -> Iterator[tuple[Dashboard, dict]]:  # type: ignore[type-arg]
    state: dict = {"calls": 0, "fail": False}  # type: ignore[type-arg]

    def source() -> dict:  # type: ignore[type-arg]
        state["calls"] += 1
        if state["fail"]:
            raise ConnectionError("endpoint gone")
        return {"run_id": "r", "phase": "RoundTrain", "round": state["calls"], "loss": math.nan,
                "participants": [{"pid": "<script>alert(1)</script>"}], "history": []}

    dash = Dashboard(source, port=0, interval=0.5, title="run <r>").start()
    try:
        yield dash, state
    finally:
        dash.stop()


def test_the_page_and_the_status_endpoint_are_served_on_loopback(board) -> None:  # type: ignore[no-untyped-def]
    dash, state = board
    assert dash.url.startswith("http://127.0.0.1:")
    code, kind, page = get(dash.url)
    assert code == 200 and kind.startswith("text/html")
    assert "run &lt;r&gt;" in page and "<title>run <r>" not in page  # the title is escaped
    assert 'id="fleet"' in page and 'id="curve-loss"' in page and "const INTERVAL = 500;" in page
    assert ".innerHTML" not in page  # run data is set as text, never as markup
    code, kind, body = get(dash.url + "api/status")
    data = json.loads(body)
    assert code == 200 and kind == "application/json"
    assert data["round"] == 1 and data["loss"] is None  # NaN is no JSON: shown as missing
    assert data["participants"][0]["pid"] == "<script>alert(1)</script>"  # JSON: the page sets it as text
    assert get(dash.url + "api/status")[0] == 200 and state["calls"] == 2  # read again at each request
    assert get(dash.url + "nope")[0] == 404


def test_a_run_that_cannot_be_read_is_a_503_with_the_reason(board) -> None:  # type: ignore[no-untyped-def]
    dash, state = board
    state["fail"] = True
    code, _, body = get(dash.url + "api/status")
    assert code == 503 and "ConnectionError: endpoint gone" in json.loads(body)["error"]
