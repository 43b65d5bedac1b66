from narwhal_serve.admission.controller import AdmissionController, Enqueued, Grant, Refusal
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.config import AdmissionConfig, PhaseConcurrency, ServingConfig


def ctrl(prefill: int = 1, decode: int = 2, queue: int = 1, retention: int = 10, wait: float = 5.0) -> AdmissionController:
    return AdmissionController(
        AdmissionConfig(mode="open", queue_limit=queue, max_wait_s=wait,
                        phase_concurrency=PhaseConcurrency(prefill=prefill, decode=decode)),
        ServingConfig(http_retention_limit=retention),
    )


def test_grant_then_queue_then_queue_full() -> None:
    c = ctrl()
    assert isinstance(c.offer("a", 0.0, 100.0), Grant)
    assert isinstance(c.offer("b", 0.0, 100.0), Enqueued)
    r = c.offer("c", 0.0, 100.0)
    assert isinstance(r, Refusal) and r.error.code == "queue_full" and r.error.retry_after == 1
    assert r.outcome is Outcome.REJECTED


def test_retention_full() -> None:
    c = ctrl(prefill=5, decode=5, retention=1)
    c.offer("a", 0.0, 100.0)
    r = c.offer("b", 0.0, 100.0)
    assert isinstance(r, Refusal) and r.error.code == "retention_full" and r.error.status == 429


def test_prefill_permit_frees_on_decode_and_decode_reservation_holds() -> None:
    c = ctrl(prefill=1, decode=2, queue=5)
    c.offer("a", 0.0, 100.0)
    assert isinstance(c.offer("b", 0.0, 100.0), Enqueued)
    c.enter_decode("a")
    granted, _ = c.pump(0.1)
    assert [t.id for t in granted] == ["b"]
    c.enter_decode("b")
    # decode reservations are now 2/2: a third request waits although no prefill is running
    assert isinstance(c.offer("c", 0.2, 100.0), Enqueued)
    c.release("a")
    assert [t.id for t in c.pump(0.3)[0]] == ["c"]
    assert c.gauges() == {"retained": 2, "queued": 0, "prefill_inflight": 1, "decode_inflight": 2}


def test_wait_expiry_kinds() -> None:
    c = ctrl(queue=5, wait=1.0)
    c.offer("a", 0.0, 100.0)
    c.offer("w", 0.0, 100.0)  # max_wait bound
    c.offer("d", 0.0, 0.5)  # request deadline bound
    _, expired = c.pump(2.0)
    codes = {t.id: r.error.code for t, r in expired}
    assert codes == {"w": "admission_wait_expired", "d": "deadline_expired"}
    assert all(r.outcome is Outcome.EXPIRED and r.error.status == 504 for _, r in expired)
    assert c.gauges()["queued"] == 0 and c.gauges()["retained"] == 1


def test_release_is_idempotent_and_frees_everything() -> None:
    c = ctrl(queue=5)
    c.offer("a", 0.0, 100.0)
    c.offer("b", 0.0, 100.0)
    assert c.release("b") and not c.release("b")
    assert c.release("a")
    assert c.gauges() == {"retained": 0, "queued": 0, "prefill_inflight": 0, "decode_inflight": 0}
