"""The key layout of a run's DynamoDB table (one place; pure, so the CDK app and the participant use it too).

One table per run, keys `pk` / `sk`:
    RUN#<run>  STATE                    the coordinator state (owned by the tick; versioned)
    RUN#<run>  P#<participant>          join and liveness facts (owned by ingest)
    RUN#<run>  O#<participant>          an initial-model offer that arrived before its join was registered
    RUN#<run>  U#<round>#<participant>  one update: accepted with its weight, or refused with a reason
    RUN#<run>  R#<round>                a finished round's summary (metrics history)
    RUN#<run>  W#<round>#<witness>      a witness proof (validated)
    RUN#<run>  H#<round>#<reporter>     a health report naming peers believed unhealthy
    RUN#<run>  COUNT#participants       how many participants have joined (bounded by max_participants)
    RUN#<run>  COUNT#U#<round>          how many update records the round has (ingest ticks on the last one)
    RUN#<run>  X#<hash of key, etag>    an object refused outside any round slot, with the reason
    RUN#<run>  upload#<window>#<participant>  objects a participant uploaded in one budget window (expires)
    RUN#<run>  dropped#<participant>    objects of a participant dropped over its upload budget, in all
    RUN#<run>  host#<host>              a host (a participant outside AWS): invited, active or revoked
    RUN#<run>  hostnonce#<host>#<nonce> a renewal's nonce, once used (expires)
    RUN#<run>  hostrate#<host, * or !>#<minute>  requests to the credential endpoint in one minute: verified ones
                                            of one host or of all (*), unverified ones (!) (expires)
    RUN#<run>  hostrefused#<host or ?>#<kind>  the credential endpoint's refusals of one kind of requests naming an
                                            invited host (? for the rest): a count, the first and the latest
                                            (expires a week after the latest)
    RUN#<run>  hostrevoked#<host>#<generation>  a revoked generation of a host, kept while a session issued before
                                            its revocation could live (expires)

Items that expire carry their epoch second in `TTL_ATTRIBUTE`, the table's time-to-live attribute.
"""

from __future__ import annotations

import hashlib

from shared.keys import ROUND_DIGITS

STATE_SK = "STATE"
PARTICIPANT_COUNT_SK = "COUNT#participants"


def run_pk(run_id: str) -> str:
    return f"RUN#{run_id}"


def lease_sk(name: str) -> str:
    """A short-lived claim on a piece of work (one round's aggregation), held by one invocation."""
    return f"LEASE#{name}"


def participant_sk(pid: str) -> str:
    return f"P#{pid}"


def offer_sk(pid: str) -> str:
    return f"O#{pid}"


def update_sk(round_no: int, pid: str = "") -> str:
    return f"U#{round_no:0{ROUND_DIGITS}d}#{pid}"


def update_count_sk(round_no: int) -> str:
    return f"COUNT#U#{round_no:0{ROUND_DIGITS}d}"


def round_sk(round_no: int) -> str:
    return f"R#{round_no:0{ROUND_DIGITS}d}"


def proof_sk(round_no: int, pid: str = "") -> str:
    return f"W#{round_no:0{ROUND_DIGITS}d}#{pid}"


def health_sk(round_no: int, pid: str = "") -> str:
    return f"H#{round_no:0{ROUND_DIGITS}d}#{pid}"


def refusal_sk(key: str, etag: str) -> str:
    return "X#" + hashlib.sha256(f"{key}\n{etag}".encode()).hexdigest()[:40]


UPLOAD_COUNT_PREFIX = "upload#"
DROPPED_PREFIX = "dropped#"


def upload_count_sk(window: int, pid: str) -> str:
    """The upload counter of participant `pid` in budget window `window` (epoch seconds // the window's length)."""
    return f"{UPLOAD_COUNT_PREFIX}{window}#{pid}"


def dropped_sk(pid: str) -> str:
    return f"{DROPPED_PREFIX}{pid}"


TTL_ATTRIBUTE = "expires_at"  # DynamoDB deletes an item some time after this epoch second (the table's TTL setting)
HOST_PREFIX = "host#"
HOST_REFUSAL_PREFIX = "hostrefused#"
ALL_HOSTS = "*"  # the rate counter's scope over every host's verified requests
UNVERIFIED = "!"  # the rate counter's scope over the requests that verify nothing (no participant id holds "!")
HOST_REVOCATION_PREFIX = "hostrevoked#"  # a revoked generation of a host (`store.hosts.HostStore.revocations`)


def host_sk(host: str) -> str:
    return f"{HOST_PREFIX}{host}"


def host_nonce_sk(host: str, nonce: str) -> str:
    return f"hostnonce#{host}#{nonce}"


def host_rate_sk(scope: str, minute: int) -> str:
    """The request counter of `scope` (a host id, or ALL_HOSTS) in the minute `minute` (epoch seconds // 60)."""
    return f"hostrate#{scope}#{minute}"


def host_refusal_sk(host: str, kind: str) -> str:
    """One item per host (or `shared.hosts.UNKNOWN_HOST`) and kind of refusal, however many arrive."""
    return f"{HOST_REFUSAL_PREFIX}{host}#{kind}"


def host_revocation_sk(host: str, generation: int) -> str:
    return f"{HOST_REVOCATION_PREFIX}{host}#{generation}"
