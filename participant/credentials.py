"""A host that joins with an invite: no AWS account, profile, CLI or environment variable, only the invite line.

The host makes an Ed25519 key of its own (kept in its host directory, mode 600), redeems the invite's one-time
secret with the key's public half, and from then on renews by requests signed with that key
(`shared.hosts.sign_renewal`). Each answer is a participant session of 15-60 minutes and where the run lives.

The session is served to every AWS client of this process, and of the processes it starts, the way ECS serves a
task's role: a loopback HTTP server in botocore's container-credentials format, named by
AWS_CONTAINER_CREDENTIALS_FULL_URI and guarded by a random AWS_CONTAINER_AUTHORIZATION_TOKEN. botocore treats those
credentials as refreshable and asks again before they expire, whichever library made the client (boto3, pynamodb);
the server renews at the endpoint once a third of the session's lifetime is left, so a round of any length never
meets an expired session. A temporary refusal (a rate limit, a clock out of the endpoint's window, a replayed nonce,
a server error) or an endpoint out of reach keeps the session it holds while that is valid and tries again with
exponential backoff and jitter; only a definite refusal (revoked, a key not bound, an expired invite) stops the
participant, with the endpoint's reason.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from hashlib import sha256
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.hosts import REDEEM_PATH, RENEW_PATH, Invite, public_key_of, secret_hash, sign_renewal
from shared.messages import CredentialAnswer, MessageError, RedeemRequest, parse_message
from shared.signing import Signer
from store.connection import Connection

log = logging.getLogger("participant.credentials")

HOST_KEY_FILE = "host-key.pem"
UPLOAD_KEY_FILE = "signing-key.pem"  # the key this host's uploads are signed with, bound with the host key
KEYS_FILE = "keys.json"  # the invite the two keys were made for: each invite (each generation) gets new keys
REDEEMED_FILE = "redeemed.json"  # the invite the keys are bound by
ENV_FULL_URI = "AWS_CONTAINER_CREDENTIALS_FULL_URI"
ENV_AUTH_TOKEN = "AWS_CONTAINER_AUTHORIZATION_TOKEN"
RENEW_AT_LEFT = 1 / 3  # renew once this share of a session's lifetime is left
# Seconds before the next try after a temporary refusal or an endpoint out of reach: doubling from the first, at most
# the last (a rate limit's window is a minute), each drawn between half and all of that (jitter, so that hosts
# refused together do not come back together).
RETRY_FIRST, RETRY_MAX = 1.0, 60.0


class HostRefused(RuntimeError):
    """The credential endpoint refused this host (revoked, expired invite, ...): retrying cannot help."""


class EndpointUnavailable(RuntimeError):
    """The endpoint could not be reached, failed, or refused for now (`temporary`: a rate limit, a clock out of its
    window, a replayed nonce): worth trying again later."""


def default_host_dir(invite: Invite) -> Path:
    """Where a host keeps its key for one run's endpoint: ~/.fed/hosts/<endpoint's digest>/<host id>."""
    return Path.home() / ".fed" / "hosts" / sha256(invite.endpoint.encode()).hexdigest()[:12] / invite.host


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise HostRefused(f"{path} does not hold an Ed25519 key: remove it to make a new one (and a new invite)")
        return key
    key = Ed25519PrivateKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return key


def post(url: str, body: dict[str, Any], timeout: float = 30.0) -> CredentialAnswer:
    """One request to the endpoint: its answer; EndpointUnavailable if it cannot be reached, fails, or refuses for
    now (429, 5xx, or a refusal it marks temporary); HostRefused if it refuses for good."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 - the invite's http(s) URL
            data = resp.read(1 << 16)
    except urllib.error.HTTPError as exc:
        reason, temporary = _refusal(exc.read(4096))
        reason = reason or str(exc.reason)
        if exc.code == 429 or exc.code >= 500 or temporary:
            raise EndpointUnavailable(f"the credential endpoint answered {exc.code}: {reason}") from None
        raise HostRefused(f"the credential endpoint refused this host ({exc.code}): {reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise EndpointUnavailable(f"the credential endpoint {url} cannot be reached: {exc}") from None
    try:
        return parse_message(CredentialAnswer, data)
    except MessageError as exc:
        raise EndpointUnavailable(f"the credential endpoint's answer is not one: {exc}") from None


def _refusal(data: bytes) -> tuple[str, bool]:
    """A refusal's reason and whether the endpoint marks it temporary (`shared.hosts.error_body`)."""
    try:
        body = json.loads(data)
        return str(body.get("error", ""))[:500], body.get("temporary") is True
    except (ValueError, AttributeError):
        return "", False


class HostSession:
    """This host's participant session: redeemed once, renewed by signed requests, kept fresh (thread-safe)."""

    def __init__(self, invite: Invite, host_dir: Path, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        self.invite = invite
        self.host_dir = host_dir
        self.clock = clock
        self._keys_for_this_invite()
        self.key = load_or_create_key(host_dir / HOST_KEY_FILE)
        self.upload_key = Signer.load_or_create(self.upload_key_path).public_key
        self.renewals = 0
        self.refused = ""  # the endpoint's reason, once it refused this host
        self._answer: CredentialAnswer | None = None
        self._issued_at = 0.0
        self._lock = threading.Lock()
        self._rng = rng or random.Random()
        self._failures = 0  # temporary refusals or failures in a row
        self._tried_at = self._retry_at = 0.0  # the last failed try; no request to the endpoint before the next
        self._failure: EndpointUnavailable | None = None  # the last one

    @property
    def upload_key_path(self) -> Path:
        """The key the participant signs its uploads with (`participant.daemon.Options.signing_key`)."""
        return self.host_dir / UPLOAD_KEY_FILE

    def _marker(self) -> dict[str, str]:
        return {"endpoint": self.invite.endpoint, "host": self.invite.host, "invite": secret_hash(self.invite.secret)}

    def _keys_for_this_invite(self) -> None:
        """New keys for a new invite (a reinstated host's new generation binds new ones; the endpoint refuses the
        earlier generations'); the same keys again for the invite they were made for (a restart)."""
        path = self.host_dir / KEYS_FILE
        try:
            if json.loads(path.read_text()) == self._marker():
                return
        except (FileNotFoundError, ValueError):
            pass
        for name in (HOST_KEY_FILE, UPLOAD_KEY_FILE, REDEEMED_FILE):
            (self.host_dir / name).unlink(missing_ok=True)
        self.host_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self._marker()))

    def _redeemed(self) -> bool:
        try:
            marker = json.loads((self.host_dir / REDEEMED_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return False
        return bool(marker == self._marker())

    def _ask(self) -> CredentialAnswer:
        """Redeem the invite the first time, renew after (and where a redemption is refused because the key was bound
        by one whose note was never written: a renewal tells)."""
        if not self._redeemed():
            redeem = RedeemRequest(host=self.invite.host, secret=self.invite.secret, public_key=public_key_of(self.key),
                                   upload_key=self.upload_key)
            try:
                answer = post(self._url(REDEEM_PATH), redeem.model_dump(mode="json"))
            except HostRefused as refused:
                try:
                    answer = self._renew()
                except HostRefused:
                    raise refused from None  # the key is not bound either: the redemption's reason is the one
            self._note_redeemed()
            return answer
        return self._renew()

    def _renew(self) -> CredentialAnswer:
        renewal = sign_renewal(self.key, self.invite.host, self.clock())
        answer = post(self._url(RENEW_PATH), renewal.model_dump(mode="json"))
        self.renewals += 1
        log.info("credentials renewed at the endpoint (renewal %d; valid until %s)", self.renewals,
                 answer.credentials.Expiration)
        return answer

    def _url(self, path: str) -> str:
        return self.invite.endpoint.rstrip("/") + path

    def _note_redeemed(self) -> None:
        (self.host_dir / REDEEMED_FILE).write_text(json.dumps(self._marker()))

    def answer(self) -> CredentialAnswer:
        """The current session, renewed first when a third of its lifetime or less is left. After a temporary refusal
        or failure the next request waits its backoff (`retry_in`), and the session held is answered while it is
        valid (EndpointUnavailable once it is not); HostRefused once the endpoint refuses this host for good (kept:
        later calls refuse at once)."""
        with self._lock:
            if self.refused:
                raise HostRefused(self.refused)
            now = self.clock()
            if self._answer is not None and \
                    self._left(now) > RENEW_AT_LEFT * max(1.0, self._expires() - self._issued_at):
                return self._answer
            if self._failure is not None and self._tried_at <= now < self._retry_at:  # (a clock set back: due)
                return self._held(now, self._failure)
            try:
                self._answer, self._issued_at = self._ask(), now
            except HostRefused as exc:
                self.refused = str(exc)
                raise
            except EndpointUnavailable as exc:
                self._failures += 1
                failed = self.clock()  # the backoff runs from when the failure is known (a try may take long)
                self._tried_at, self._retry_at, self._failure = failed, failed + self._backoff(), exc
                log.warning("%s; trying again in %.0f s", exc, self._retry_at - failed)
                return self._held(failed, exc)
            self._failures, self._retry_at, self._failure = 0, 0.0, None
            return self._answer

    def refusal(self) -> str:
        """Why the endpoint refuses this host for good, asking it now if it has not said so yet ("" if it does not
        refuse it, or cannot be asked). For a participant stopped by a denial it cannot explain: a revocation cuts
        the live session by IAM before any renewal is refused, and only the endpoint knows its reason."""
        with self._lock:
            if not self.refused and self._redeemed():
                try:
                    self._renew()
                except HostRefused as exc:
                    self.refused = str(exc)
                except EndpointUnavailable:
                    pass
            return self.refused

    def _held(self, now: float, failure: EndpointUnavailable) -> CredentialAnswer:
        """The session held while it is valid (botocore keeps using it); the failure once it is not."""
        if self._answer is not None and self._left(now) > 0:
            return self._answer
        raise EndpointUnavailable(f"{failure} (next try in {self._retry_at - now:.0f} s)")

    def _backoff(self) -> float:
        """Exponential, bounded, jittered: between half and all of RETRY_FIRST x 2^(failures - 1), at most
        RETRY_MAX."""
        ceiling = min(RETRY_MAX, RETRY_FIRST * 2.0 ** min(self._failures - 1, 32))
        return ceiling * (0.5 + 0.5 * self._rng.random())

    def retry_in(self) -> float:
        """Seconds until the endpoint may be asked again (0: now)."""
        return max(0.0, self._retry_at - self.clock())

    def _expires(self) -> float:
        assert self._answer is not None
        return datetime.strptime(self._answer.credentials.Expiration, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=UTC).timestamp()

    def _left(self, now: float) -> float:
        return self._expires() - now

    def connection(self) -> Connection:
        c = self.answer().connection
        return Connection(run_id=c.run_id, bucket=c.bucket, table=c.table, endpoint=c.endpoint, region=c.region,
                          participant_role=c.participant_role, state_topic=c.state_topic)

    def wait_for_first(self, stop: threading.Event) -> CredentialAnswer:
        """The first session, trying again after each backoff while the endpoint cannot give it (until `stop`)."""
        while True:
            try:
                return self.answer()
            except EndpointUnavailable:
                if stop.wait(max(self.retry_in(), 0.01)):
                    raise


class CredentialServer:
    """botocore's container-credentials endpoint on loopback, serving `session`; `start` points this process's
    environment at it (and so every process it starts), `stop` takes it away."""

    def __init__(self, session: HostSession, on_refused: Callable[[str], None] = lambda reason: None) -> None:
        self.session = session
        self.on_refused = on_refused
        self.token = secrets.token_urlsafe(32)
        self._server: ThreadingHTTPServer | None = None
        self._saved: dict[str, str | None] = {}

    def start(self) -> CredentialServer:
        handler = _handler_for(self)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self._server.serve_forever, name="host-credentials", daemon=True).start()
        port = self._server.server_address[1]
        values = {ENV_FULL_URI: f"http://127.0.0.1:{port}/credentials", ENV_AUTH_TOKEN: self.token,
                  "AWS_EC2_METADATA_DISABLED": "true"}
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            values[name] = ""  # nothing earlier in botocore's chain may shadow the host's session
        for name, value in values.items():
            self._saved.setdefault(name, os.environ.get(name))
            if value:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved = {}

    def body(self) -> tuple[int, dict[str, str]]:
        try:
            c = self.session.answer().credentials
        except HostRefused as exc:
            self.on_refused(str(exc))
            return 403, {"message": str(exc)}
        except EndpointUnavailable as exc:  # botocore keeps the session it has until it expires
            log.warning("%s", exc)
            return 503, {"message": str(exc)}
        return 200, {"AccessKeyId": c.AccessKeyId, "SecretAccessKey": c.SecretAccessKey, "Token": c.SessionToken,
                     "Expiration": c.Expiration}


def _handler_for(server: CredentialServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not secrets.compare_digest(self.headers.get("Authorization", ""), server.token):
                status, body = 401, {"message": "not authorized"}
            else:
                status, body = server.body()
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            return None

    return Handler
