"""The reads of a relayed answer, and its continuations: each engine read bounded by the idle
timeout, the first-token limit and the deadline (``_batches``); an answer cut after its first token
resumed on another engine where that can be exact (``_resume``: docs/contract.md, "Engine
failures"; the rules are ``relay/resume.py``'s), and answers on an engine whose breaker opened cut
to be resumed (``cut_engine``).  The base of :class:`~narwhal_serve.relay.pipeline.Relay`, which
sets what is declared here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.client import stream_chunks
from narwhal_serve.engines.dialect import PATHS
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.legs import prioritized
from narwhal_serve.errors import BadEngineResponse
from narwhal_serve.observability import Tracing, end_span
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.relay.attempt import Attempt, BreakerCut, DeadlinePassed, cut_reason, faults_of
from narwhal_serve.relay.coalesce import coalesce
from narwhal_serve.relay.messages import EngineWorked
from narwhal_serve.relay.resume import (
    DivergedResume, Reshaper, continuation_body, length_end, resume_refusal, resume_target, unbounded,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span


log = logging.getLogger(__name__)


class ResumingReads:
    """Reads under their limits, and continuations (set by ``Relay.__init__``)."""

    client: httpx.AsyncClient
    clock: Callable[[], float]
    idle_timeout_s: float
    max_resumes: int
    live_targets: Callable[[int], list[EngineConfig]] | None
    live_context: Callable[[str], int | None] | None  # an engine's context, as the lease's view says it
    detokenize: Callable[[list[int]], str] | None  # the model's tokenizer's decode (Transcript.settle)
    resume_first_token_s: float
    coalesce_reads: bool
    tracing: Tracing | None
    _active: dict[Attempt, PlacedRequest]

    def cut_engine(self, name: str, why: str) -> int:
        """Engine ``name``'s circuit breaker opened: each answer streaming from it past its first
        token that can be resumed exactly on another engine now is cut and resumed there (reason
        ``breaker_open``); the others go on where they are (they may well finish).  How many."""
        cut = 0
        for at, placed in self._active.items():
            if (at.cursor.engine != name or at.wait_from is not None or at.cut_by is not None
                    or at.transcript.finish_reason is not None):
                continue
            if self._resume_to(placed, at, at.excluded | {name})[1] is None:
                continue
            at.cut_by = why
            if at.timer is not None and not at.timer.expired():  # the read under way ends now (else the next one does not start)
                at.timer.reschedule(asyncio.get_running_loop().time())
            cut += 1
        return cut

    def _resume_to(self, placed: PlacedRequest, at: Attempt,
                   excluded: set[str]) -> tuple[str | None, EngineConfig | None]:
        """Where an answer cut now would be continued, never on an engine of ``excluded`` (None,
        target), or why it would not be (an outcome label of narwhal_resumes_total, None)."""
        if at.transcript.unsure and self.detokenize is not None:
            try:
                at.transcript.settle(self.detokenize)
            except Exception:  # (a tokenizer that cannot decode these IDs: unsure stays, not resumed)
                log.warning("resume: could not decode the output's last tokens", exc_info=True)
        why = resume_refusal(placed.request, at.transcript, at.route.decode, at.resumes, self.max_resumes,
                             self.clock(), placed.deadline)
        if why is not None:
            return why, None
        t = at.transcript
        tokens = len(t.prompt_ids or ()) + len(t.output_ids)
        target = resume_target(self.live_targets(tokens) if self.live_targets is not None else [], placed.candidates,
                               excluded)
        if target is None:
            return "no_engine", None
        if unbounded(placed.request) and self._context(target) is None:
            return "not_exact", None  # its limit would be vLLM's default of 16 tokens
        return None, target

    def _context(self, target: EngineConfig) -> int | None:
        return self.live_context(target.name) if self.live_context is not None else None

    async def _batches(
        self, stream: AsyncIterator[list[dict[str, Any]]], placed: PlacedRequest, at: Attempt
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """``stream``'s batches, each awaited within the idle timeout, the first-token limit (until
        the first token) and the deadline."""
        while True:
            if at.cut_by is not None:
                why, at.cut_by = at.cut_by, None
                raise BreakerCut(at.cursor.engine, why)
            now = self.clock()
            left = placed.deadline - now
            limit, why = self.idle_timeout_s, f"engine silent for {self.idle_timeout_s:g} s"
            if at.first_limit is not None and at.wait_from is not None:
                first_left = at.wait_from + at.first_limit - now
                if first_left < limit:
                    limit, why = max(0.0, first_left), f"no first token within {at.first_limit:g} s"
            by_deadline = left <= limit  # which limit this wait runs under
            try:
                async with asyncio.timeout(max(0.0, min(limit, left))) as at.timer:
                    batch = await stream.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                if at.cut_by is not None:
                    continue  # cut_engine ended the read: the loop's top raises it
                # (the loop's timer may fire a hair before the wall clock reaches the deadline)
                if by_deadline or self.clock() >= placed.deadline:
                    raise DeadlinePassed() from None
                raise EngineFailure(at.cursor.engine, why, timed_out=True) from None
            finally:
                at.timer = None
            yield batch

    async def _resume(
        self, placed: PlacedRequest, at: Attempt, headers: dict[str, str], failure: EngineFailure | BadEngineResponse,
        span: "Span | None" = None,
    ) -> AsyncGenerator[Any, None]:
        """One cut: its continuation's batches; a failed continuation is yielded as its exception
        (the next cut); a cut that cannot be resumed raises ``failure``.  The continuation is a leg of
        its own below the attempt's ``span`` (``narwhal.resume``: the engine gets its traceparent)."""
        req, t = placed.request, at.transcript
        reason = cut_reason(failure)
        failed_on = at.cursor.engine
        at.excluded.add(failed_on)
        if t.finish_reason is not None:  # cut after the last token: only the end was lost
            at.notes.append((reason, "finished"))
            at.health.extend(faults_of(failure, at.route))  # (the engine failed all the same)
            return
        why, target = self._resume_to(placed, at, at.excluded)
        if target is None:
            at.notes.append((reason, why or "no_engine"))
            raise failure
        assert t.prompt_ids is not None
        # (a cut inside a character: continued from before its first bytes, generated again)
        kept = len(t.output_ids) - t.silent
        body = continuation_body(req, t.prompt_ids, t.output_ids[:kept], self._context(target))
        if body is None:  # every token the client allowed was generated: only the end was lost
            at.notes.append((reason, "finished"))
            at.health.extend(faults_of(failure, at.route))
            yield [length_end(req, t)]
            return
        at.resumes += 1
        at.health.extend(faults_of(failure, at.route))
        at.resumed_from.append(failed_on)
        shaper = Reshaper(req, t, body["prompt"], redo=t.output_ids[kept:])
        at.route, at.cursor.engine = RouteChoice("single", target), target.name
        at.first_limit, at.wait_from = self.resume_first_token_s, self.clock()
        opened, last_token = at.wait_from, at.meter.last or at.wait_from
        at.turnarounds.append(max(0.0, opened - (at.cut_at or opened)))
        leg = self.tracing.start("narwhal.resume", parent=span, client=True,
                                 attributes={"narwhal.engine": target.name}) if self.tracing is not None else None
        leg_headers = headers if leg is None or self.tracing is None else {**headers, **self.tracing.headers_of(leg)}
        leg_error: str | None = None
        stream = stream_chunks(self.client, target.name, target.base_url + PATHS["completion"],
                               prioritized(target, body, placed.priority), leg_headers)
        if self.coalesce_reads:
            stream = coalesce(stream)
        try:
            async for batch in self._batches(stream, placed, at):
                now = self.clock()
                # (reshape raises BadEngineResponse on a continuation that ran another prompt)
                out, bad = at.checked(batch, now, shaper.reshape)
                if at.wait_from is not None and at.meter.last is not None and at.meter.last > opened:
                    at.wait_from = None
                    at.notes.append((reason, "resumed"))
                    at.moved = at.route.engines
                    at.health.append(EngineWorked(at.route.engines))
                    at.gaps.append(now - last_token)
                    at.prefills.append(now - opened)
                if out:
                    yield out
                if bad is not None:
                    raise bad
            if at.wait_from is not None:
                at.notes.append((reason, "resumed"))
                at.moved = at.route.engines
            return
        except DeadlinePassed:
            leg_error = "deadline_expired"
            if at.wait_from is not None:  # (every cut is counted: this one by the deadline)
                at.notes.append((reason, "deadline"))
            raise
        except (EngineFailure, BadEngineResponse) as exc:
            leg_error = f"{type(exc).__name__}: {exc}"
            if at.wait_from is not None:  # the continuation failed before its first token
                at.notes.append((reason, "not_exact" if isinstance(exc, DivergedResume) else "failed"))
                raise exc from None
            yield exc
        except Exception as exc:  # (marked failed as leg_span marks the other legs)
            leg_error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                await stream.aclose()
            finally:
                end_span(leg, leg_error)
