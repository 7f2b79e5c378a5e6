"""Route selection and the breaker (gateway.providers.routing): pure state, a fake clock."""

from __future__ import annotations

from collections import Counter

from gateway.harness.usage import Price
from gateway.providers.routing import Breaker, Deployment, Group, RoutePlan, Router

CHEAP, DEAR = Price(1.0, 2.0), Price(5.0, 1.0)
A = Deployment("a", None, 3, CHEAP)
B = Deployment("b", "b-model", 1, DEAR)
F = Deployment("f", None, 1, Price(0.5, 20.0))
PLAN = RoutePlan((Group(None, (A, B)), Group("fallback-model", (F,))), retries=2, breaker=Breaker(2, 10.0))


def test_an_idle_route_splits_calls_by_weight_exactly() -> None:
    router = Router()
    picks = Counter()
    for _ in range(400):
        pick = router.pick(PLAN, "m", (), 0.0)
        router.started(pick.deployment)
        router.finished(pick.deployment, "ok", PLAN.breaker, 0.0)
        picks[pick.deployment.upstream] += 1
    assert picks == {"a": 300, "b": 100}


def test_the_next_call_goes_where_fewest_wait_relative_to_weight() -> None:
    router = Router()
    for _ in range(3):
        router.started(A)  # a: 3 in flight / weight 3 = 1; b: 0
    assert router.pick(PLAN, "m", (), 0.0).deployment == B
    router.started(B)
    router.started(B)  # b: 2 / 1 = 2 > a's 1
    assert router.pick(PLAN, "m", (), 0.0).deployment == A


def test_model_names_come_from_the_deployment_the_fallback_or_the_client() -> None:
    router = Router()
    assert router.pick(PLAN, "m", (), 0.0).model == "m"  # a: the client's name
    assert router.pick(PLAN, "m", (A,), 0.0).model == "b-model"
    pick = router.pick(PLAN, "m", (A, B), 0.0)
    assert (pick.deployment, pick.model, pick.group) == (F, "fallback-model", 1)


def test_a_deployment_is_cooled_after_failures_and_probed_back_once() -> None:
    router = Router()
    breaker = PLAN.breaker
    router.started(A)
    assert not router.finished(A, "server_error", breaker, 0.0)  # 1 of 2
    router.started(A)
    assert router.finished(A, "timeout", breaker, 1.0)  # 2 of 2: cooling until 11
    assert [router.pick(PLAN, "m", (), 5.0).deployment for _ in range(3)] == [B] * 3
    probe = router.pick(PLAN, "m", (), 11.0)
    assert probe.deployment == A and probe.probe
    assert router.pick(PLAN, "m", (), 11.0).deployment == B  # one probe at a time
    router.started(A)
    assert router.finished(A, "server_error", breaker, 12.0)  # a failed probe: twice as long, until 32
    assert router.pick(PLAN, "m", (), 31.0).deployment == B
    probe = router.pick(PLAN, "m", (), 32.0)
    assert probe.deployment == A and probe.probe
    router.started(A)
    router.finished(A, "ok", breaker, 33.0)
    assert router.cooling() == []
    assert not router.pick(PLAN, "m", (), 33.0).probe


def test_a_request_fault_does_not_cool_a_deployment() -> None:
    router = Router()
    for _ in range(5):
        router.started(A)
        assert not router.finished(A, "rejected", PLAN.breaker, 0.0)
    assert router.cooling() == []


def test_retry_after_keeps_a_deployment_out_and_cools_it_at_least_that_long() -> None:
    router = Router()
    router.started(B)
    router.finished(B, "rate_limited", PLAN.breaker, 0.0, retry_after_s=4.0)
    assert {router.pick(PLAN, "m", (), 3.0).deployment for _ in range(4)} == {A}
    router.started(B)
    assert router.finished(B, "rate_limited", PLAN.breaker, 4.0, retry_after_s=60.0)
    assert router.health(B).ready_at() == 64.0  # the upstream's 60 s beats the breaker's 10 s


def test_when_every_deployment_is_cooling_the_first_back_is_picked_with_its_wait() -> None:
    router = Router()
    for d, at in ((A, 0.0), (B, 1.0), (F, 2.0)):
        for _ in range(2):
            router.started(d)
            router.finished(d, "unreachable", PLAN.breaker, at)
    pick = router.pick(PLAN, "m", (), 5.0)
    assert pick.deployment == A and pick.wait_s == 5.0 and pick.probe
    router.abandoned(pick)
    assert router.pick(PLAN, "m", (), 10.0).deployment == A  # its probe slot was given back


def test_the_hold_price_covers_every_deployment_and_fallback() -> None:
    assert PLAN.hold_price() == Price(5.0, 20.0)


def test_a_lone_deployment_is_never_cooled_but_its_retry_after_is_waited_for() -> None:
    lone = RoutePlan((Group(None, (A,)),), retries=2, breaker=Breaker(1, 10.0))
    router = Router()
    router.started(A)
    router.finished(A, "server_error", lone.breaker, 0.0)
    pick = router.pick(lone, "m", (A,), 1.0)
    assert (pick.deployment, pick.wait_s, pick.probe) == (A, 0.0, False)
    router.started(A)
    router.finished(A, "rate_limited", lone.breaker, 1.0, retry_after_s=3.0)
    assert router.pick(lone, "m", (A,), 2.0).wait_s == 2.0
