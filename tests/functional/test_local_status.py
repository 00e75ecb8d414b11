"""`fed status`: what it says about a run, from the records alone (no store, no clock)."""

from __future__ import annotations

import json

from rich.console import Console

from fed.status import RefusalLine, describe, render, render_json
from shared.config import RunConfig
from shared.state import Member, MemberStatus, ParticipantView, Phase, RoundSummary, RunState, UpdateView

NOW = 1_000.0
CONFIG = RunConfig(run_id="status-run", min_clients=2, min_per_round=2, total_rounds=10, liveness_timeout=20)


def summary(round_no: int, seconds: float, **kw: object) -> RoundSummary:
    values: dict = dict(round=round_no, epoch=1, selected=("a", "b"), counted=("a", "b"), refused={}, dropped={},
                        samples=100, loss=0.5, accuracy=0.9, started=0.0, ended=seconds, aggregated=True)
    values.update(kw)
    return RoundSummary(**values)


def test_participants_rounds_and_refusals_are_described() -> None:
    # Given a run training round 3: a uploaded, b refused, c dropped, d silent, e pending for the next epoch
    state = RunState(
        "status-run", version=7, phase=Phase.TRAIN, epoch=1, round=3, aggregated=3, deadline=NOW + 42,
        members={"a": Member(), "b": Member(), "c": Member(MemberStatus.DROPPED, 990.0, "silent for 21s"),
                 "d": Member()},
        selected=("a", "b", "d"),
    )
    seen = {"a": 998.0, "b": 999.0, "c": 960.0, "d": 985.0, "e": 999.5}
    participants = {p: ParticipantView(p, 900.0, t) for p, t in seen.items()}
    updates = {
        "a": UpdateView("a", 3, True, 100, metrics={"loss": 0.25}),
        "b": UpdateView("b", 3, False, reason="wrong shape for w: [3], expected [2]"),
    }
    refused = [RefusalLine(3, "b", "runs/status-run/rounds/000003/b", "wrong shape for w: [3], expected [2]", 999.0)]
    other = [RefusalLine(None, "", "runs/status-run/junk", "key is outside the run layout", 998.0)]
    rounds = [summary(r, 2.0 + r) for r in range(3)]

    # When it is described
    status = describe(state, participants, updates, refused, other, rounds, CONFIG, NOW)

    # Then each participant's state, selection, round progress and liveness are right
    lines = {p.pid: p for p in status.participants}
    assert (lines["a"].state, lines["a"].selected, lines["a"].round_status) == ("active", True, "uploaded")
    assert lines["a"].round_detail == "loss 0.2500"
    assert (lines["b"].round_status, lines["b"].round_detail) == ("refused", "wrong shape for w: [3], expected [2]")
    assert (lines["c"].state, lines["c"].reason) == ("dropped", "silent for 21s")
    assert lines["d"].round_status == "training" and lines["d"].silent and lines["d"].last_seen_ago == 15.0
    assert lines["e"].state == "pending" and not lines["e"].selected
    # and the phase, deadline, refusals (oldest first) and round history with an ETA
    assert (status.phase, status.epoch, status.round, status.deadline_in) == ("RoundTrain", 1, 3, 42.0)
    assert [r.reason for r in status.refusals] == ["key is outside the run layout", refused[0].reason]
    assert [r.round for r in status.rounds] == [0, 1, 2]
    assert status.round_seconds == 3.0 and status.eta_seconds == 7 * 3.0

    # and it renders without error, naming the refusal reason
    console = Console(width=160, record=True)
    console.print(render(status))
    assert "wrong shape" in console.export_text()


def test_a_run_that_has_not_started_says_so() -> None:
    status = describe(RunState("status-run"), {}, {}, [], [], [], None, NOW)
    assert status.notes == ["the coordinator has not ticked yet: no run state"]
    assert status.deadline_in is None and status.eta_seconds is None
    Console(width=100, record=True).print(render(status))


def test_a_finished_run_has_no_deadline_or_eta() -> None:
    state = RunState("status-run", version=30, phase=Phase.FINISHED, epoch=1, round=10, aggregated=10,
                     deadline=0.0, members={"a": Member(), "b": Member()})
    status = describe(state, {}, {}, [], [], [summary(9, 1.0)], CONFIG, NOW)
    assert status.deadline_in is None and status.eta_seconds is None
    assert all(p.round_status == "-" for p in status.participants)


def test_strikes_toward_a_health_drop_are_shown() -> None:
    # Given round 5's health: b attested by none of the witnesses, its first strike of the two that drop a member
    state = RunState(
        "status-run", version=9, phase=Phase.TRAIN, epoch=1, round=6, aggregated=6, deadline=NOW + 10,
        members={"a": Member(), "b": Member(), "c": Member()}, selected=("a", "b", "c"), witnesses=("a", "c"),
        health_round=5, health={"a": 2, "b": 0, "c": 2}, health_quorum=2, strikes={"b": 1}, strikes_needed=2,
    )
    # When it is described and rendered
    status = describe(state, {}, {}, [], [], [], CONFIG.model_copy(update={"witness_nodes": 2}), NOW)
    console = Console(width=200, record=True)
    console.print(render(status))
    text = console.export_text()
    # Then b's strike shows in its row, and in the summary with how many drop a member
    w = status.witnessing
    assert w is not None and w.strikes == {"b": 1} and w.strikes_needed == 2
    assert {p.pid: p.strikes for p in status.participants} == {"a": 0, "b": 1, "c": 0}
    assert "0 (strike 1/2)" in text
    assert "unattested witnessed rounds in a row (a health report drops at 2): b 1 of 2" in text
    assert json.loads(render_json(status))["witnessing"]["strikes"] == {"b": 1}


def test_witnesses_proofs_health_and_drops_are_described() -> None:
    from shared.witness import Proof

    # Given round 4 witnessed by a and b (a's proof in), and round 3's health: c attested by none
    config = CONFIG.model_copy(update={"witness_nodes": 2})
    state = RunState(
        "status-run", version=9, phase=Phase.TRAIN, epoch=1, round=4, aggregated=4, deadline=NOW + 10,
        members={"a": Member(), "b": Member(),
                 "c": Member(MemberStatus.DROPPED, 995.0, "health check: round 3 attested by 0 of 2 witnesses needed")},
        selected=("a", "b"), witnesses=("a", "b"), health_round=3, health={"a": 2, "b": 2, "c": 0}, health_quorum=2,
    )
    proofs = {"a": Proof.build("status-run", 4, "a", 0, {"a": "d" * 64}, 2, complete=True)}
    rounds = [summary(3, 2.0, selected=("a", "b", "c"), witnesses=("a", "b"), proofs=2, quorum=2,
                      dropped={"c": state.members["c"].reason})]

    # When it is described and rendered
    status = describe(state, {}, {}, [], [], rounds, config, NOW, proofs=proofs)
    console = Console(width=200, record=True)
    console.print(render(status))
    text = console.export_text()

    # Then the witnesses, the proofs in, the health scores and the drop with its reason are all there
    w = status.witnessing
    assert w is not None and w.witnesses == ["a", "b"] and w.proofs == {"a": True} and w.quorum == 2
    assert (w.health_round, w.health, w.health_quorum) == (3, {"a": 2, "b": 2, "c": 0}, 2)
    lines = {p.pid: p for p in status.participants}
    assert (lines["a"].witness, lines["b"].witness, lines["c"].witness) == ("proof in", "witness", "")
    assert (lines["a"].health, lines["c"].health) == (2, 0)
    assert [(d.round, d.pid) for d in status.drops] == [(3, "c")] and status.drops[0].reason.startswith("health check")
    assert "1 of 2 proofs in" in text and "round 3 health" in text and "below the quorum: c" in text
    assert "health check: round 3 attested by 0" in text and "2/2" in text


def test_refusals_are_shown_bounded_without_control_characters_or_markup() -> None:
    # Given a refusal whose key and reason quote 100 KB of attacker text, terminal escapes and console markup
    state = RunState("status-run", version=3, phase=Phase.TRAIN, epoch=1, round=0, members={"a": Member()},
                     selected=("a",))
    hostile = "[bold red]owned[/] \x1b[2J\r" + "x" * 100_000
    refused = [RefusalLine(None, "a", "runs/status-run/" + hostile, "unexpected tensors: " + hostile, NOW)]
    status = describe(state, {"a": ParticipantView("a", 900.0, NOW)}, {}, [], refused, [], CONFIG, NOW)
    # When it is rendered
    console = Console(width=200, record=True)
    console.print(render(status))
    text = console.export_text()
    # Then the table shows a bounded, printable excerpt, cut to its column, the markup as literal text
    assert "[bold red]owned[/]" in text and "\x1b" not in text and "\r" not in text
    assert len(text) < 10_000 and "xxx…" in text


def test_the_fleet_view_shows_progress_throughput_share_host_and_who_is_stuck_or_slow() -> None:
    # Given a round sized by throughput: fast trains, slow missed the last deadline (kept with a smaller share),
    # stuck heartbeats but its progress has not moved for 90 s, and fast once had an update refused
    from shared.sizing import Share, Speed

    config = RunConfig(run_id="status-run", min_clients=2, min_per_round=2, total_rounds=10, liveness_timeout=20,
                       stuck_timeout=60, batch_size=10)
    members = {p: Member() for p in ("fast", "slow", "stuck")}
    state = RunState(
        "status-run", version=9, phase=Phase.TRAIN, epoch=1, round=4, aggregated=4, deadline=NOW + 100,
        members=members, selected=("fast", "slow", "stuck"), round_started=NOW - 100, late=("slow",),
        plan=(Share("fast", 1000), Share("slow", 250), Share("stuck", 1000)), round_units=2250.0,
        speeds={"fast": Speed(100.0, 2.0), "slow": Speed(25.0, 2.0), "stuck": Speed(100.0, 2.0)},
    )
    participants = {
        "fast": ParticipantView("fast", 900.0, NOW - 1, progress_round=4, progress_done=5, progress_total=10,
                                progress_at=NOW - 1, rate=98.5),
        "slow": ParticipantView("slow", 900.0, NOW - 2, progress_round=4, progress_done=1, progress_total=4,
                                progress_at=NOW - 2, rate=24.0),
        "stuck": ParticipantView("stuck", 900.0, NOW - 1, progress_round=4, progress_done=3, progress_total=10,
                                 progress_at=NOW - 90),
    }
    info = {"fast": {"host": "gpu-1", "device": "cuda:0", "gpu": "NVIDIA H100", "activity": "training round 4 (50%)"},
            "slow": {"host": "old-box", "device": "cpu", "activity": "training round 4 (25%)"}}
    refused = [RefusalLine(2, "fast", "runs/status-run/rounds/000002/fast", "non-finite values in w", 950.0)]
    rounds = [summary(r, 20.0, dropped={"slow": "missed the deadline of round 1"} if r == 1 else {})
              for r in range(4)]

    # When it is described
    status = describe(state, participants, {}, refused, [], rounds, config, NOW, info=info)

    # Then every row has the fleet view's fields
    lines = {p.pid: p for p in status.participants}
    fast, slow, stuck = lines["fast"], lines["slow"], lines["stuck"]
    assert (fast.condition, slow.condition, stuck.condition) == ("ok", "slow", "stuck")
    assert stuck.round_status == "stuck"
    assert (fast.progress, fast.progress_round, slow.progress, stuck.progress) == (50.0, 4, 25.0, 30.0)
    assert (fast.samples_per_second, fast.reported_rate, slow.samples_per_second) == (100.0, 98.5, 25.0)
    assert (fast.share, slow.share) == (round(1000 / 2250, 4), round(250 / 2250, 4))
    assert fast.predicted_seconds == 2.0 + 1000 / 100 and slow.predicted_seconds == 2.0 + 250 / 25
    assert (fast.host, fast.device, fast.activity) == ("gpu-1", "cuda:0 (NVIDIA H100)", "training round 4 (50%)")
    assert slow.drops == ["round 1: missed the deadline of round 1"]
    assert fast.refusals == ["round 2: non-finite values in w"]
    # and the ETA comes from the measured throughput: 6 rounds left at the predicted 12 s
    assert status.predicted_round_seconds == 12.0 and status.eta_seconds == 6 * 12.0
    assert status.work_sizing == "throughput"
    # and the JSON has all of it; the tables render it
    body = status.to_json()
    row = next(p for p in body["participants"] if p["pid"] == "stuck")
    assert {"condition", "activity", "progress", "samples_per_second", "share", "host", "device", "drops",
            "refusals", "health", "last_seen_ago"} <= set(row)
    console = Console(width=220, record=True)
    console.print(render(status))
    text = console.export_text()
    assert "stuck" in text and "slow" in text and "gpu-1" in text and "predicted 12.0s" in text


def test_suspect_witnesses_are_shown_with_why() -> None:
    # Given a round whose witness b refused an update the two other witnesses attested
    config = CONFIG.model_copy(update={"witness_nodes": 3})
    state = RunState("status-run", version=9, phase=Phase.TRAIN, epoch=1, round=4, aggregated=4, deadline=NOW + 10,
                     members={"a": Member(), "b": Member(), "c": Member()}, selected=("a", "b", "c"))
    why = "refused the update of a, which 2 other witness(es) attested"
    rounds = [summary(3, 2.0, selected=("a", "b", "c"), witnesses=("a", "b", "c"), proofs=3, quorum=2,
                      suspects={"b": why})]

    # When it is described and rendered
    status = describe(state, {}, {}, [], [], rounds, config, NOW)
    console = Console(width=200, record=True)
    console.print(render(status))

    # Then the suspect and why are there
    assert [(s.round, s.pid, s.reason) for s in status.suspects] == [(3, "b", why)]
    text = console.export_text()
    assert "suspect witnesses" in text and why in text


def finished_run() -> tuple[RunState, dict[str, ParticipantView], list[RoundSummary]]:
    """A run finished after 10 rounds: a and b members to the end (silent since: they exited), c dropped in round
    4, d joined too late to be admitted."""
    state = RunState("status-run", version=40, phase=Phase.FINISHED, epoch=1, round=10, aggregated=10,
                     members={"a": Member(), "b": Member(), "c": Member(MemberStatus.DROPPED, 500.0, "silent for 21s")},
                     global_digest="ab" * 32)
    participants = {p: ParticipantView(p, 100.0, NOW - 300) for p in ("a", "b", "c", "d")}
    rounds = [summary(r, 3.0, counted=("a", "b") if r != 9 else ("a",), global_digest=f"{r:02d}" * 32)
              for r in range(10)]
    return state, participants, rounds


def test_a_finished_run_shows_its_members_finished_and_where_its_result_is() -> None:
    state, participants, rounds = finished_run()
    status = describe(state, participants, {}, [], [], rounds, CONFIG, NOW, named="--connection run.json")

    lines = {p.pid: p for p in status.participants}
    assert (lines["a"].state, lines["a"].condition, lines["a"].reason) == ("finished", "finished",
                                                                          "last trained round 9")
    assert (lines["b"].state, lines["b"].reason) == ("finished", "last trained round 8")
    assert not lines["a"].silent and not lines["b"].silent and lines["a"].activity == ""
    assert (lines["c"].state, lines["c"].condition, lines["c"].reason) == ("dropped", "dropped", "silent for 21s")
    assert lines["d"].state == "pending" and lines["d"].condition == "-"
    result = status.result
    assert result is not None and result.round == 10 and result.digest == "ab" * 32
    assert result.key == f"runs/status-run/rounds/{10:06d}/global/{'ab' * 32}"
    assert (result.loss, result.accuracy) == (0.5, 0.9)
    assert result.fetch == "fed export --round 10 --connection run.json global.safetensors"
    console = Console(width=200, record=True)
    console.print(render(status, 200))
    text = console.export_text()
    assert "final global model: round 10 (loss 0.5000, accuracy 0.9000)" in text and result.key in text
    assert result.fetch in text and "silent" not in text.split("participants")[1].split("dropped")[0]


def test_a_member_that_uploaded_and_waits_for_the_round_to_close_is_not_silent() -> None:
    state = RunState("status-run", version=9, phase=Phase.TRAIN, epoch=1, round=3, aggregated=3,
                     deadline=NOW + 30, members={"a": Member(), "b": Member()}, selected=("a", "b"))
    participants = {"a": ParticipantView("a", 100.0, NOW - 15), "b": ParticipantView("b", 100.0, NOW - 15)}
    updates = {"a": UpdateView("a", 3, True, 100, metrics={"loss": 0.2})}
    lines = {p.pid: p for p in describe(state, participants, updates, [], [], [], CONFIG, NOW).participants}
    assert (lines["a"].round_status, lines["a"].condition, lines["a"].silent) == ("uploaded", "ok", False)
    assert (lines["b"].round_status, lines["b"].condition, lines["b"].silent) == ("training", "silent", True)


def table_rows(text: str, title: str) -> list[str]:
    """The lines of the table titled `title` that hold cells (its header, then one per row unless one wrapped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("└"):
            break
        if line.startswith(("│", "┃")):
            rows.append(line)
    return rows


def test_status_fits_the_terminal_it_is_printed_to() -> None:
    # Given a run with witnesses (two more columns), hosts, devices and long reasons
    config = CONFIG.model_copy(update={"witness_nodes": 2})
    members = {f"gpu-host-{i:02d}": Member() for i in range(8)}
    state = RunState("status-run", version=9, phase=Phase.TRAIN, epoch=1, round=4, aggregated=4, deadline=NOW + 9,
                     members=members, selected=tuple(members), witnesses=("gpu-host-00", "gpu-host-01"))
    participants = {p: ParticipantView(p, 100.0, NOW - 3, progress_round=4, progress_done=3, progress_total=10,
                                       progress_at=NOW - 3, rate=123.4) for p in members}
    info = {p: {"host": f"{p}.lab.example.org", "device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3",
                "activity": "training round 4: epoch 1 of 3, batch 117 of 400, loss 0.4312"} for p in members}
    status = describe(state, participants, {}, [], [], [summary(r, 9.0) for r in range(4)], config, NOW, info=info)

    for width in (80, 200):
        # When it is printed to a terminal that wide
        console = Console(width=width, record=True)
        console.print(render(status, width))
        text = console.export_text()

        # Then no line is wider, no participant's row wraps, and no cell is cut to fewer than 6 characters
        assert max(len(line) for line in text.splitlines()) <= width
        rows = table_rows(text, "participants")
        assert len(rows) == 1 + len(members), "\n".join(rows)
        cells = [c.strip() for row in rows[1:] for c in row.strip("│").split("│")]
        assert all(len(c) >= 6 for c in cells if c.endswith("…")), [c for c in cells if c.endswith("…")]
        header = [c.strip() for c in rows[0].strip("┃").split("┃")]
        assert not any(c.endswith("…") for c in header), header
        # and the columns that matter most are there, whole
        assert {"participant", "condition", "this round", "progress", "last seen", "why"} <= set(header), header
    # and at 200 columns, every one of them
    assert {"state", "selected", "samples/s", "share", "witness", "health", "host / device"} <= set(header), header
