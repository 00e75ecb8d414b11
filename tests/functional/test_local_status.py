"""`fed status`: what it says about a run, from the records alone (no store, no clock)."""

from __future__ import annotations

from rich.console import Console

from fed.status import RefusalLine, describe, render
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
    # Then the table shows a bounded, printable excerpt, the markup as literal text
    assert "[bold red]owned[/]" in text and "\x1b" not in text and "\r" not in text
    assert len(text) < 10_000 and "more characters" in text
