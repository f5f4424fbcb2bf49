"""The control API (Contract 3), served by the proxy itself under ``/_lh/``.

Reachable on the reverse listener and, in forward mode, on the host ``lightning.proxy``;
authenticated with ``Authorization: Bearer <control token>``, a secret of its own that no harness
receives. Also takes a harness's own reward at ``/lh/<rollout~attempt>/<credential>/reward``
(attribution has checked that credential, so the reward can only be the attempt's own).

Every control or reward request is answered here, whatever happens: a failing call (a flush on a
full disk) becomes a 5xx JSON answer from the proxy. Were it left unanswered, mitmproxy would
forward it, control bearer included, to the upstream, and the caller would read the upstream's
answer as the proxy's.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import time
import urllib.parse
import uuid
from datetime import UTC, datetime

from mitmproxy import http

from ...schemas import BufferFull
from ...schemas.rewards import MAX_REWARD_BYTES, MAX_REWARD_POSTS, RewardError, reward_from_object
from ..codec import TooLarge, decode_body
from ..credentials import InvalidId, check_attempt, check_model_version, check_rollout_id, log_safe
from ..state import CONTROL, META, REWARD, ProxyState, keep_newest
from .answers import json_answer

log = logging.getLogger("lightning.proxy")


class BadRequest(ValueError):
    status = 400


class TooLargeReward(BadRequest):
    status = 413


class TooManyRewards(BadRequest):
    status = 429


def _body(flow: http.HTTPFlow) -> dict:
    return _object(flow.request.content or b"")


def _reward_body(flow: http.HTTPFlow) -> dict:
    """A harness's reward body, at most ``MAX_REWARD_BYTES`` as sent and decoded (the reward file's bound).

    Why: the harness is hostile, and what it posts is decoded, redacted on the proxy's event loop (every
    rollout waits meanwhile) and stored in the rewards table the launcher reads whole. mitmproxy's own
    decoding has no cap: a 300 KB gzip body became 300 MB (3.5 GB peak, other rollouts stalled 18 s).
    A compressed body is decoded with a running cap instead (``codec.decode_body``); a length announced
    past twice the bound is cut off unread before this (``limits.Limits``)."""
    raw = flow.request.raw_content or b""
    too_big = TooLargeReward(f"a reward body is at most {MAX_REWARD_BYTES} bytes, decoded too: a number and a "
                             "little info")
    if len(raw) > MAX_REWARD_BYTES:
        raise too_big
    try:  # (no Content-Encoding, or identity: the bytes as sent)
        raw = decode_body(raw, flow.request.headers.get("Content-Encoding", ""), MAX_REWARD_BYTES)
    except TooLarge:
        raise too_big from None
    except ValueError as exc:  # an unknown coding, corrupt data
        raise BadRequest(str(exc)) from None
    return _object(raw)


def _object(raw: bytes) -> dict:
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (RecursionError: nested deeper than the parser goes)
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("body must be a JSON object")
    return obj


REMEMBERED_ATTEMPTS = 4096  # whose reward posts are counted (MAX_REWARD_POSTS; the oldest forgotten first)


class Control:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.reward_posts: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Refused on its headers without the control token: its body is then not wanted (read to
        64 KiB at most) and not counted with the trainer's own calls (``limits.HeldBodies``)."""
        call = flow.metadata.get(META)
        if call is not None and call.kind == CONTROL and flow.response is None and not self._authorized(flow):
            json_answer(flow, 401, {"error": "control API needs Authorization: Bearer <control token>"})

    async def request(self, flow: http.HTTPFlow) -> None:
        call = flow.metadata.get(META)
        if call is None or call.kind not in (CONTROL, REWARD) or flow.response is not None:
            return
        try:
            if call.kind == REWARD:
                return self._harness_reward(flow, call)
            await self._dispatch(flow)  # (the token was checked on the headers: requestheaders)
        except (BadRequest, InvalidId, RewardError) as exc:
            json_answer(flow, getattr(exc, "status", 400), {"error": str(exc)})
        except BufferFull as exc:  # rewards cannot be buffered while writes fail: the caller retries
            json_answer(flow, 503, {"error": str(exc)})
        except Exception as exc:  # answered here, never forwarded (see module doc)
            log.exception("control call %s failed", log_safe(call.path or ""))
            json_answer(flow, 500, {"error": f"control call failed: {type(exc).__name__}: {exc}"})
        finally:
            flow.request.headers.pop("Authorization", None)
            if flow.response is None:
                json_answer(flow, 500, {"error": "control call not answered"})

    def _harness_reward(self, flow: http.HTTPFlow, call) -> None:
        if flow.request.method != "POST":
            return json_answer(flow, 405, {"error": "POST {\"reward\": number, \"info\": {...}}"})
        self._count_reward_post(call.rollout_id, call.attempt)
        value, info = reward_from_object(_reward_body(flow))
        row = self.write_reward(call.rollout_id, call.attempt, value, info, "proxy", call.secrets, call.key_secrets)
        return json_answer(flow, 200, {"ok": True, "reward_id": row})

    def _count_reward_post(self, rollout_id: str, attempt: int) -> None:
        """Count one reward post of the attempt; past ``MAX_REWARD_POSTS``, refuse it (429)."""
        key = (rollout_id, attempt)
        n = keep_newest(self.reward_posts, key, self.reward_posts.get(key, 0) + 1, REMEMBERED_ATTEMPTS)
        if n > MAX_REWARD_POSTS:
            raise TooManyRewards(f"an attempt may report its reward {MAX_REWARD_POSTS} times (the latest counts); "
                                 f"this was report {n}")

    def _authorized(self, flow: http.HTTPFlow) -> bool:
        secret = self.state.config.control_secret
        if not secret:
            return True
        given = flow.request.headers.get("Authorization", "")
        scheme, _, tok = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(tok.strip().encode(), secret.encode())

    async def _dispatch(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        path = req.path.split("?", 1)[0].rstrip("/")
        name = path[len("/_lh/"):] if path.startswith("/_lh/") else path.lstrip("/")
        query = dict(urllib.parse.parse_qsl(req.path.split("?", 1)[1])) if "?" in req.path else {}
        st = self.state
        if name == "state" and req.method == "GET":
            return json_answer(flow, 200, st.snapshot())
        if req.method != "POST":
            return json_answer(flow, 405, {"error": f"{req.method} {path} is not a control call"})
        if name in ("pause", "resume"):
            getattr(st, name)()
            return json_answer(flow, 200, st.snapshot())
        if name == "drain":
            try:
                timeout = float(query.get("timeout", _body(flow).get("timeout", 60)))
            except (TypeError, ValueError):
                raise BadRequest("timeout must be a number of seconds") from None
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(st.idle_event.wait(), timeout=max(0.0, timeout))
            except TimeoutError:
                pass
            waited = round(time.monotonic() - t0, 3)
            return json_answer(flow, 200, {"drained": st.in_flight == 0, "in_flight": st.in_flight, "waited_s": waited})
        if name == "model_version":
            st.model_version = check_model_version(_body(flow).get("version"))
            return json_answer(flow, 200, st.snapshot())
        if name == "reward":
            body = _body(flow)
            rid, attempt = check_rollout_id(body.get("rollout_id")), check_attempt(body.get("attempt", 0))
            source = body.get("source") or "api"
            if not isinstance(source, str) or len(source) > 64:
                raise BadRequest("source must be a string of at most 64 characters")
            value, info = reward_from_object(body)
            rid_row = self.write_reward(rid, attempt, value, info, source)
            return json_answer(flow, 200, {"ok": True, "reward_id": rid_row})
        if name == "end":
            body = _body(flow)
            rid, attempt = check_rollout_id(body.get("rollout_id")), check_attempt(body.get("attempt", 0))
            st.revoked.revoke(rid, attempt)
            return json_answer(flow, 200, {"ok": True, "ended": f"{rid}~{attempt}", "revoked": len(st.revoked)})
        if name == "flush":
            await asyncio.get_running_loop().run_in_executor(None, st.flush)
            return json_answer(flow, 200, st.snapshot())
        return json_answer(flow, 404, {"error": f"unknown control call {path}"})

    def write_reward(self, rollout_id, attempt, value: float, info: dict | None, source: str, secrets=(),
                     keys=()) -> str:
        """Append one reward row; ``secrets``, ``keys``: the posting harness's credentials, masked in ``info``."""
        if not rollout_id:
            raise BadRequest("a reward needs a rollout (credentials or rollout_id)")
        reward_id = uuid.uuid4().hex
        self.state.rewards.append({
            "reward_id": reward_id, "rollout_id": rollout_id, "attempt": check_attempt(attempt or 0), "reward": value,
            "created_at": datetime.now(UTC), "source": source,
            "info_json": self.state.redactor.json_text(json.dumps(info or {}), secrets, keys),
        })
        self.state.rewards_captured += 1
        return reward_id
