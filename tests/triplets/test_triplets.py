"""The span -> triplet -> row adapter, on real Span objects built by the small helpers below."""

from __future__ import annotations

import dataclasses
import gc
import json
from typing import Any

import numpy as np
import pytest

from lightning_grpc import semconv
from lightning_grpc.triplets import (
    CALL_DROP_REASONS,
    AdapterConfig,
    Drop,
    DropReason,
    FallbackReason,
    RolloutTriplets,
    Triplet,
    rows_from_triplets,
    triplets_from_spans,
)
from lightning_grpc.triplets.calls import other_choices, read_call
from lightning_grpc.triplets.tree import LOST_PARENT, VIRTUAL_ROOT, Node, TraceTree
from lightning_grpc.types import Span

T0 = 1_700_000_000_000_000_000  # ns
_sequence = iter(range(1, 1_000_000))


def at(tick: int) -> int:
    """A time: ``tick`` milliseconds after T0."""
    return T0 + tick * 1_000_000


def span(
    span_id: str,
    name: str = "step",
    *,
    parent: str = "",
    times: tuple[int, int] | None = (0, 100),
    seq: int | None = None,
    attrs: dict[str, Any] | None = None,
    status: int = 0,
    status_message: str = "",
    attempt: str = "at-1",
) -> Span:
    return Span(
        trace_id="t" * 32,
        span_id=span_id,
        name=name,
        rollout_id="ro-1",
        attempt_id=attempt,
        sequence_id=seq if seq is not None else next(_sequence),
        parent_span_id=parent,
        start_time_unix_nano=at(times[0]) if times else 0,
        end_time_unix_nano=at(times[1]) if times else 0,
        status_code=status,
        status_message=status_message,
        attributes=dict(attrs or {}),
    )


def llm(
    span_id: str,
    prompt: list[int] | None,
    response: list[int] | None,
    *,
    logprobs: list[float] | None = None,
    response_id: str = "",
    finish: str = "stop",
    version: int = 3,
    streamed: bool = False,
    body: dict[str, Any] | None = None,
    error: str = "",
    **kwargs: Any,
) -> Span:
    """A span as the proxy writes it for one LLM call."""
    attrs: dict[str, Any] = {
        semconv.LLM_MODEL: "m",
        semconv.LLM_POLICY_VERSION: version,
        semconv.LLM_STREAMED: streamed,
        semconv.LLM_FINISH_REASON: finish,
        semconv.LLM_RESPONSE_ID: response_id or f"chatcmpl-{span_id}",
    }
    if prompt is not None:
        attrs[semconv.LLM_PROMPT_TOKEN_IDS] = prompt
    if response is not None:
        attrs[semconv.LLM_RESPONSE_TOKEN_IDS] = response
    if logprobs is not None:
        attrs[semconv.LLM_RESPONSE_LOGPROBS] = logprobs
    if body is not None:
        attrs[semconv.LLM_RESPONSE] = json.dumps(body, separators=(",", ":"))
    if error:
        attrs[semconv.LLM_ERROR] = error
    kwargs.setdefault("status", 2 if error else 1)
    return span(span_id, semconv.SPAN_LLM_CALL, attrs=attrs, **kwargs)


def reward(
    span_id: str, value: float | dict[str, float], *, primary: str | None = None, **kwargs: Any
) -> Span:
    """A reward span as ``emit_reward`` writes it."""
    return span(span_id, semconv.SPAN_REWARD, attrs=semconv.reward_attributes(value, primary), **kwargs)


def operation(span_id: str, op_name: str, **kwargs: Any) -> Span:
    """An operation span as ``@operation`` writes it."""
    return span(span_id, semconv.SPAN_OPERATION, attrs={semconv.OPERATION_NAME: op_name}, **kwargs)


def agent(span_id: str, agent_name: str, **kwargs: Any) -> Span:
    return span(span_id, "agent", attrs={semconv.AGENT_NAME: agent_name}, **kwargs)


def ids(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def drops_of(result: RolloutTriplets) -> list[tuple[str, str, int]]:
    return [(str(d.reason), d.span_id, d.call_index) for d in result.drops]


def trained(result: RolloutTriplets) -> list[str]:
    return [t.span_id for t in result.triplets]


def assert_accounts_for_every_call(result: RolloutTriplets) -> None:
    call_drops = [d for d in result.drops if d.reason in CALL_DROP_REASONS]
    assert result.calls == len(result.triplets) + len(call_drops)


# ------------------------------------------------------------------ trace tree


def test_tree_orders_children_by_start_time_then_sequence_id() -> None:
    spans = [
        span("c3", parent="root", times=(5, 6), seq=3),
        span("c2", parent="root", times=(1, 2), seq=6),
        span("root", times=(0, 10), seq=9),
        span("c1", parent="root", times=(1, 2), seq=5),
        span("g1", parent="c1", times=(1, 2), seq=7),
    ]
    tree = TraceTree.from_spans(spans)
    assert tree.root is not None and tree.root.span_id == "root" and not tree.root.is_virtual
    assert [c.span_id for c in tree.root.children] == ["c1", "c2", "c3"]
    assert [n.span_id for n in tree.walk()] == ["root", "c1", "g1", "c2", "c3"]
    assert tree.nodes["g1"].parent is tree.nodes["c1"]


def test_tree_with_several_roots_hangs_them_under_a_virtual_root() -> None:
    tree = TraceTree.from_spans([span("b", times=(3, 9)), span("a", times=(1, 5))])
    root = tree.root
    assert root is not None and root.is_virtual
    assert (root.span_id, root.name) == (VIRTUAL_ROOT, VIRTUAL_ROOT)
    assert (root.start, root.end) == (at(1), at(9))
    assert [c.span_id for c in root.children] == ["a", "b"]
    assert all(c.parent is root for c in root.children)


def test_tree_of_no_spans_is_empty_and_gives_no_triplets() -> None:
    assert TraceTree.from_spans([]).root is None
    result = triplets_from_spans([])
    assert (result.triplets, result.drops, result.reward, result.calls) == ([], [], None, 0)


def test_tree_turns_a_lost_parent_into_a_virtual_node_holding_its_children() -> None:
    spans = [
        span("a", times=(0, 10)),
        span("b", parent="gone", times=(2, 4)),
        span("c", parent="gone", times=(3, 7)),
    ]
    tree = TraceTree.from_spans(spans)
    root = tree.root
    assert root is not None and root.span_id == VIRTUAL_ROOT
    assert [c.span_id for c in root.children] == ["a", "gone"]
    lost = root.children[1]
    assert lost.is_virtual and lost.name == LOST_PARENT and lost.span is None
    assert [c.span_id for c in lost.children] == ["b", "c"]
    assert (lost.start, lost.end) == (at(2), at(7))
    assert "gone" not in tree.nodes


def test_tree_cuts_parent_cycles() -> None:
    spans = [
        span("x", parent="y", times=(1, 2)),
        span("y", parent="x", times=(3, 4)),
        span("self", parent="self", times=(5, 6)),
        span("root", times=(0, 9)),
    ]
    tree = TraceTree.from_spans(spans)
    walked = [n.span_id for n in tree.walk()]
    assert sorted(walked) == sorted([VIRTUAL_ROOT, "root", "x", "y", "self"])
    assert tree.nodes["y"].parent is tree.nodes["x"]
    assert tree.nodes["x"].parent is tree.root


def test_repair_moves_an_orphan_call_under_the_tightest_enclosing_span() -> None:
    spans = [
        span("session", times=(0, 100)),
        agent("agent", "solver", parent="session", times=(10, 50)),
        operation("step", "think", parent="agent", times=(15, 35)),
        span("later", parent="session", times=(60, 90)),
        # another LLM call that encloses the orphan more tightly never adopts it
        llm("inner", [1], [2], parent="agent", times=(19, 31)),
        llm("orphan", [1, 2], [3], times=(20, 30)),
    ]
    tree = TraceTree.from_spans(spans)
    assert tree.root is not None and tree.root.span_id == VIRTUAL_ROOT
    moved = tree.repair_orphan_calls()
    assert [n.span_id for n in moved] == ["orphan"]
    assert tree.nodes["orphan"].parent is tree.nodes["step"]
    assert tree.root is tree.nodes["session"] and tree.root.parent is None  # the virtual root went away


def test_repair_prefers_the_deeper_span_when_two_enclose_equally() -> None:
    spans = [
        agent("agent", "solver", times=(10, 50)),
        operation("same", "tool", parent="agent", times=(10, 50)),
        llm("orphan", [1], [2], times=(20, 30)),
    ]
    tree = TraceTree.from_spans(spans)
    tree.repair_orphan_calls()
    assert tree.nodes["orphan"].parent is tree.nodes["same"]


def test_repair_leaves_calls_without_times_or_enclosing_span() -> None:
    spans = [
        agent("agent", "solver", times=(10, 50)),
        llm("untimed", [1], [2], times=None),
        llm("outside", [3], [4], times=(40, 60)),
    ]
    tree = TraceTree.from_spans(spans)
    assert tree.repair_orphan_calls() == []
    assert tree.root is not None and tree.root.span_id == VIRTUAL_ROOT
    assert tree.nodes["untimed"].parent is tree.root
    assert tree.nodes["outside"].parent is tree.root


def test_repair_moves_a_call_whose_parent_was_lost() -> None:
    spans = [
        agent("agent", "solver", times=(0, 100)),
        llm("call", [1], [2], parent="http-span", times=(20, 30)),
    ]
    tree = TraceTree.from_spans(spans)
    assert tree.nodes["call"].parent is not None and tree.nodes["call"].parent.name == LOST_PARENT
    tree.repair_orphan_calls()
    assert tree.nodes["call"].parent is tree.nodes["agent"]
    assert tree.root is tree.nodes["agent"]
    assert [n.span_id for n in tree.walk()] == ["agent", "call"]


def test_a_rollouts_tree_is_freed_as_its_triplets_are_read_without_the_cyclic_collector() -> None:
    """A node and its parent refer to each other; the tree is released once read, so nothing of it is left
    for Python's cyclic garbage collector (the Trainer reads a tree for every finished rollout)."""
    spans = [
        agent("agent", "solver", times=(0, 100)),
        # a lost parent: a virtual node, then moved
        llm("call", [1], [2], parent="http-span", times=(20, 30)),
        llm("call-2", [3], [4], parent="agent", times=(40, 50)),
        reward("r", 1.0, parent="agent", times=(60, 61)),
    ]
    gc.collect()
    gc.disable()
    try:
        result = triplets_from_spans(spans)
        left = [o for o in gc.get_objects() if type(o) is Node]
    finally:
        gc.enable()
    assert trained(result) == ["call", "call-2"] and result.reward == 1.0
    assert left == []


# ------------------------------------------------------------------ triplets


def test_a_call_becomes_a_triplet_with_its_exact_ids_and_facts() -> None:
    spans = [
        agent("agent", "solver", times=(0, 100)),
        llm(
            "call",
            [101, 102, 103],
            [7, 8],
            logprobs=[-0.5, -0.25],
            parent="agent",
            times=(10, 20),
            response_id="chatcmpl-1",
            finish="length",
            version=12,
        ),
        reward("r", 0.75, parent="agent", times=(30, 31)),
    ]
    result = triplets_from_spans(spans)
    assert result.calls == 1 and result.drops == [] and result.reward == 0.75
    (t,) = result.triplets
    assert t.prompt_ids.dtype == np.int32 and t.response_ids.dtype == np.int32
    np.testing.assert_array_equal(t.prompt_ids, ids([101, 102, 103]))
    np.testing.assert_array_equal(t.response_ids, ids([7, 8]))
    assert t.logprobs is not None and t.logprobs.dtype == np.float32
    np.testing.assert_array_equal(t.logprobs, np.array([-0.5, -0.25], dtype=np.float32))
    assert (t.reward, t.span_id, t.response_id, t.model, t.policy_version) == (
        0.75,
        "call",
        "chatcmpl-1",
        "m",
        12,
    )
    assert (t.call_index, t.agent_name, t.finish_reason, t.streamed) == (0, "solver", "length", False)


def test_calls_are_ordered_by_start_time_then_sequence_id() -> None:
    spans = [
        llm("c", [5], [6], times=(20, 21), seq=1),
        llm("b", [3], [4], times=(10, 11), seq=8),
        llm("a", [1], [2], times=(10, 11), seq=7),
    ]
    result = triplets_from_spans(spans)
    assert trained(result) == ["a", "b", "c"]
    assert [t.call_index for t in result.triplets] == [0, 1, 2]


def test_agent_match_requires_repair_when_the_call_sits_outside_the_agent() -> None:
    spans = [
        agent("agent", "solver", times=(0, 100)),
        llm("call", [1, 2], [3], times=(10, 20)),
        reward("r", 1.0, parent="agent", times=(50, 51)),
    ]
    repaired = triplets_from_spans(spans, AdapterConfig(agent_match="solv"))
    assert trained(repaired) == ["call"]
    assert repaired.triplets[0].agent_name == "solver" and repaired.triplets[0].reward == 1.0

    unrepaired = triplets_from_spans(spans, AdapterConfig(agent_match="solv", repair_hierarchy=False))
    assert unrepaired.triplets == []
    assert unrepaired.drops == [Drop(DropReason.OTHER_AGENT, "call", 0, "no agent above the call")]
    assert unrepaired.reward == 1.0


def test_dedup_by_response_id_and_calls_without_ids_are_dropped_and_the_reward_matched() -> None:
    spans = [
        agent("agent", "agent-a", times=(0, 100)),
        llm("first", [1, 2], [3, 4], parent="agent", times=(10, 20), response_id="r1"),
        llm("copy", [5], [6], parent="agent", times=(12, 22), response_id="r1"),
        llm("empty", [7, 8], [], parent="agent", times=(30, 40)),
        reward("r", 0.5, parent="agent", times=(45, 46)),
    ]
    result = triplets_from_spans(spans, AdapterConfig(agent_match="agent-a", reward_match="first_occurrence"))
    assert trained(result) == ["copy"]
    assert result.triplets[0].reward == 0.5
    assert result.drops == [
        Drop(DropReason.DUPLICATE_CALL, "first", 0, "same response id as call 1"),
        Drop(DropReason.NO_TOKEN_IDS, "empty", 2, "response ids empty"),
    ]
    assert_accounts_for_every_call(result)


def test_retried_calls_keep_the_last_successful_one() -> None:
    prompt = [11, 12, 13]
    spans = [
        llm("try1", prompt, [1], times=(10, 20)),
        llm("try2", prompt, [2], times=(21, 30)),
        llm("try3", prompt, None, times=(31, 40), error="upstream timed out"),
        llm("next", [*prompt, 2, 14], [3], times=(41, 50)),
    ]
    result = triplets_from_spans(spans)
    assert trained(result) == ["try2", "next"]
    assert [t.call_index for t in result.triplets] == [0, 1]
    np.testing.assert_array_equal(result.triplets[0].response_ids, ids([2]))
    assert result.drops == [
        Drop(DropReason.DUPLICATE_CALL, "try1", 0, "retry of call 1 (same prompt ids)"),
        Drop(DropReason.CALL_ERROR, "try3", 2, "upstream timed out"),
    ]
    assert result.calls == 4
    assert_accounts_for_every_call(result)


def test_errored_calls_are_dropped_by_status_or_error_attribute() -> None:
    spans = [
        llm("by-status", [1], [2], times=(10, 20), status=2, status_message="HTTP 500"),
        llm("by-attribute", [3], [4], times=(21, 30), error="connection reset"),
        llm("bare-status", [5], [6], times=(31, 40), status=2),
        llm("ok", [7], [8], times=(41, 50)),
    ]
    result = triplets_from_spans(spans)
    assert trained(result) == ["ok"]
    assert result.drops == [
        Drop(DropReason.CALL_ERROR, "by-status", 0, "HTTP 500"),
        Drop(DropReason.CALL_ERROR, "by-attribute", 1, "connection reset"),
        Drop(DropReason.CALL_ERROR, "bare-status", 2, "span status ERROR"),
    ]


def test_judge_calls_under_a_reward_scope_are_not_trained() -> None:
    spans = [
        agent("agent", "solver", times=(0, 100)),
        llm("solve", [1], [2], parent="agent", times=(10, 20)),
        operation("judge-op", semconv.SPAN_REWARD, parent="agent", times=(30, 50)),
        llm("judge1", [3], [4], parent="judge-op", times=(31, 40)),
        reward("reward-span", 0.25, parent="judge-op", times=(41, 45)),
        llm("judge2", [5], [6], parent="reward-span", times=(42, 43)),
        span("graded", parent="agent", times=(60, 70), attrs=semconv.reward_attributes(0.5)),
        llm("judge3", [7], [8], parent="graded", times=(61, 62)),
    ]
    result = triplets_from_spans(spans)
    assert trained(result) == ["solve"]
    assert drops_of(result) == [
        ("judge_call", "judge1", 1),
        ("judge_call", "judge2", 2),
        ("judge_call", "judge3", 3),
    ]
    assert all(d.detail == "made inside a reward scope" for d in result.drops)
    assert result.reward == 0.5  # the last reward span: "graded"
    assert result.triplets[0].reward == 0.5

    kept = triplets_from_spans(spans, AdapterConfig(exclude_calls_under_reward=False))
    assert trained(kept) == ["solve", "judge1", "judge2", "judge3"]
    assert kept.triplets[1].agent_name == "solver"  # a reward operation names no agent


def test_agent_match_keeps_only_the_matching_agent() -> None:
    spans = [
        span("session", times=(0, 100)),
        operation("planner", "planner", parent="session", times=(0, 30)),
        llm("p", [1], [2], parent="planner", times=(5, 10)),
        agent("coder", "coder", parent="session", times=(30, 60)),
        llm("c", [3], [4], parent="coder", times=(35, 40)),
        span("sdk", "agents.run", parent="session", times=(60, 90), attrs={"agent.name": "reviewer"}),
        llm("r", [5], [6], parent="sdk", times=(65, 70)),
        llm("loose", [7], [8], parent="session", times=(91, 92)),
    ]
    everyone = triplets_from_spans(spans)
    assert [(t.span_id, t.agent_name) for t in everyone.triplets] == [
        ("p", "planner"),
        ("c", "coder"),
        ("r", "reviewer"),
        ("loose", ""),
    ]
    coder = triplets_from_spans(spans, AdapterConfig(agent_match="^coder$"))
    assert trained(coder) == ["c"]
    assert coder.triplets[0].call_index == 0
    assert coder.drops == [
        Drop(DropReason.OTHER_AGENT, "p", 0, "agent 'planner' does not match agent_match"),
        Drop(DropReason.OTHER_AGENT, "r", 2, "agent 'reviewer' does not match agent_match"),
        Drop(DropReason.OTHER_AGENT, "loose", 3, "no agent above the call"),
    ]
    assert_accounts_for_every_call(coder)


def test_a_nested_agent_that_does_not_match_switches_training_off_below_it() -> None:
    spans = [
        agent("agent", "solver", times=(0, 100)),
        llm("own", [1], [2], parent="agent", times=(5, 10)),
        operation("tool", "summarizer", parent="agent", times=(20, 40)),
        llm("nested", [3], [4], parent="tool", times=(25, 30)),
    ]
    result = triplets_from_spans(spans, AdapterConfig(agent_match="^solver$"))
    assert trained(result) == ["own"]
    assert drops_of(result) == [("other_agent", "nested", 1)]


def test_a_streamed_call_is_trained_like_any_other() -> None:
    spans = [llm("s", [1, 2, 3], [4, 5, 6], logprobs=[-1.0, -2.0, -3.0], streamed=True, times=(10, 20))]
    (t,) = triplets_from_spans(spans).triplets
    assert t.streamed is True
    np.testing.assert_array_equal(t.prompt_ids, ids([1, 2, 3]))
    np.testing.assert_array_equal(t.response_ids, ids([4, 5, 6]))
    assert t.logprobs is not None
    np.testing.assert_array_equal(t.logprobs, np.array([-1.0, -2.0, -3.0], dtype=np.float32))


def n_choices_body() -> dict[str, Any]:
    return {
        "id": "chatcmpl-n",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "token_ids": [3],
                "finish_reason": "stop",
                "logprobs": {"content": [{"logprob": -0.5}]},
            },
            {
                "index": 1,
                "token_ids": [4, 5],
                "finish_reason": "length",
                "logprobs": {"content": [{"logprob": -0.25}, {"logprob": -0.125}]},
            },
            {"index": 2, "token_ids": [6], "finish_reason": "stop"},
        ],
    }


def test_n_choices_train_the_choice_the_next_prompt_continues() -> None:
    spans = [
        llm("n", [1, 2], [3], logprobs=[-0.5], body=n_choices_body(), times=(10, 20)),
        llm("next", [1, 2, 4, 5, 9], [10], times=(30, 40)),
    ]
    result = triplets_from_spans(spans)
    assert trained(result) == ["n", "next"]
    first = result.triplets[0]
    np.testing.assert_array_equal(first.response_ids, ids([4, 5]))
    assert first.logprobs is not None
    np.testing.assert_array_equal(first.logprobs, np.array([-0.25, -0.125], dtype=np.float32))
    assert first.finish_reason == "length"
    assert result.drops == [
        Drop(DropReason.UNUSED_CHOICE, "n", 0, "choice 0 of 3, trained 1"),
        Drop(DropReason.UNUSED_CHOICE, "n", 0, "choice 2 of 3, trained 1"),
    ]
    assert result.calls == 2
    assert_accounts_for_every_call(result)


def test_n_choices_nobody_continues_train_choice_0() -> None:
    spans = [llm("n", [1, 2], [3], logprobs=[-0.5], body=n_choices_body(), times=(10, 20))]
    result = triplets_from_spans(spans)
    (t,) = result.triplets
    np.testing.assert_array_equal(t.response_ids, ids([3]))
    assert t.logprobs is not None
    np.testing.assert_array_equal(t.logprobs, np.array([-0.5], dtype=np.float32))
    assert t.finish_reason == "stop"
    assert drops_of(result) == [("unused_choice", "n", 0), ("unused_choice", "n", 0)]
    assert [d.detail for d in result.drops] == ["choice 1 of 3, trained 0", "choice 2 of 3, trained 0"]


def test_a_rollout_without_llm_calls_has_only_its_reward() -> None:
    spans = [agent("agent", "solver", times=(0, 10)), reward("r", 1.0, parent="agent", times=(5, 6))]
    result = triplets_from_spans(spans, AdapterConfig(reward_match="first_occurrence"))
    assert (result.triplets, result.calls, result.reward) == ([], 0, 1.0)
    assert result.drops == [
        Drop(DropReason.UNMATCHED_REWARD, "r", -1, "reward 1.0: no earlier finished unrewarded call")
    ]
    assert triplets_from_spans(spans).drops == []


def test_a_rollout_without_reward_has_reward_none() -> None:
    result = triplets_from_spans([llm("a", [1], [2], times=(1, 2)), llm("b", [1, 2, 3], [4], times=(3, 4))])
    assert result.reward is None
    assert [t.reward for t in result.triplets] == [None, None]


def test_final_reward_is_the_last_reward_span_exact_and_goes_to_the_last_call() -> None:
    exact = 0.1 + 0.2  # 0.30000000000000004, not representable in float32
    spans = [
        llm("a", [1], [2], times=(1, 2)),
        reward("early", 0.25, times=(3, 4)),
        llm("b", [1, 2, 3], [4], times=(5, 6)),
        reward("late", exact, times=(7, 8)),
    ]
    result = triplets_from_spans(spans)
    assert result.reward == exact
    assert [t.reward for t in result.triplets] == [None, exact]


def test_multi_dimensional_rewards_read_the_primary_or_the_named_dimension() -> None:
    spans = [
        llm("a", [1], [2], times=(1, 2)),
        reward("r", {"accuracy": 0.7, "length": -0.125}, primary="accuracy", times=(3, 4)),
    ]
    assert triplets_from_spans(spans).triplets[0].reward == 0.7
    by_length = triplets_from_spans(spans, AdapterConfig(reward_dimension="length"))
    assert (by_length.reward, by_length.triplets[0].reward) == (-0.125, -0.125)
    absent = triplets_from_spans(spans, AdapterConfig(reward_dimension="style"))
    assert (absent.reward, absent.triplets[0].reward) == (None, None)


def test_first_occurrence_gives_each_reward_to_the_latest_finished_unrewarded_call() -> None:
    spans = [
        llm("c1", [1], [2], times=(10, 20)),
        reward("r1", 0.1, times=(25, 26)),
        llm("c2", [3], [4], times=(30, 40)),
        reward("r2", 0.2, times=(35, 36)),  # c2 has not finished, c1 is taken
        reward("r3", 0.3, times=(50, 51)),
        reward("r4", 0.4, times=(60, 61)),  # every call is taken
    ]
    result = triplets_from_spans(spans, AdapterConfig(reward_match="first_occurrence"))
    assert [(t.span_id, t.reward) for t in result.triplets] == [("c1", 0.1), ("c2", 0.3)]
    assert drops_of(result) == [("unmatched_reward", "r2", -1), ("unmatched_reward", "r4", -1)]
    assert result.reward == 0.4


def test_first_sibling_matches_only_a_reward_beside_the_call() -> None:
    spans = [
        span("session", times=(0, 100)),
        agent("a", "alpha", parent="session", times=(0, 40)),
        llm("a1", [1], [2], parent="a", times=(5, 10)),
        reward("ra", 0.5, parent="a", times=(20, 21)),
        agent("b", "beta", parent="session", times=(40, 80)),
        llm("b1", [3], [4], parent="b", times=(45, 50)),
        reward("rs", 0.9, parent="session", times=(90, 91)),
    ]
    result = triplets_from_spans(spans, AdapterConfig(reward_match="first_sibling"))
    assert [(t.span_id, t.reward) for t in result.triplets] == [("a1", 0.5), ("b1", None)]
    assert drops_of(result) == [("unmatched_reward", "rs", -1)]
    occurrence = triplets_from_spans(spans, AdapterConfig(reward_match="first_occurrence"))
    assert [(t.span_id, t.reward) for t in occurrence.triplets] == [("a1", 0.5), ("b1", 0.9)]


def test_spans_of_several_attempts_or_rollouts_raise() -> None:
    with pytest.raises(ValueError, match="2 attempts"):
        triplets_from_spans([llm("a", [1], [2]), llm("b", [3], [4], attempt="at-2")])
    other = llm("b", [3], [4])
    other.rollout_id = "ro-2"
    with pytest.raises(ValueError, match="2 rollouts"):
        triplets_from_spans([llm("a", [1], [2]), other])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggregation": "episode"}, "unknown aggregation"),
        ({"reward_match": "last"}, "unknown reward_match"),
        ({"agent_match": "(unclosed"}, "not a valid regular expression"),
        ({"reward_dimension": ""}, "reward_dimension"),
    ],
)
def test_bad_config_values_raise(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdapterConfig(**kwargs)


def test_logprobs_are_kept_only_when_finite_and_one_per_token() -> None:
    spans = [
        llm("short", [1], [2, 3], logprobs=[-1.0], times=(1, 2)),
        llm("nan", [4], [5], logprobs=[float("nan")], times=(3, 4)),
        llm("none", [6], [7], times=(5, 6)),
    ]
    assert [t.logprobs for t in triplets_from_spans(spans).triplets] == [None, None, None]


def test_missing_or_malformed_ids_are_dropped_with_what_is_wrong() -> None:
    spans = [
        llm("no-prompt", None, [1], times=(1, 2)),
        llm("text-prompt", ["a", "b"], [1], times=(3, 4)),  # type: ignore[list-item]
        llm("negative", [1, -2], [1], times=(5, 6)),
        llm("no-response", [9], None, times=(7, 8)),
    ]
    result = triplets_from_spans(spans)
    assert result.triplets == []
    assert [(d.reason, d.detail) for d in result.drops] == [
        (DropReason.NO_TOKEN_IDS, "prompt ids missing"),
        (DropReason.NO_TOKEN_IDS, "prompt ids malformed"),
        (DropReason.NO_TOKEN_IDS, "prompt ids malformed"),
        (DropReason.NO_TOKEN_IDS, "response ids missing"),
    ]


def test_a_span_given_twice_is_read_once() -> None:
    call = llm("c", [1], [2], times=(1, 2))
    result = triplets_from_spans([call, call])
    assert trained(result) == ["c"]
    assert result.drops == [Drop(DropReason.DUPLICATE_CALL, "c", -1, "span id given twice")]
    assert result.calls == 2
    assert_accounts_for_every_call(result)


# ------------------------------------------------------------------ rows


def triplet(
    call_index: int,
    prompt: list[int],
    response: list[int],
    logprobs: list[float] | None = None,
    reward: float | None = None,
    forced: list[int] | None = None,
) -> Triplet:
    return Triplet(
        prompt_ids=ids(prompt),
        response_ids=ids(response),
        logprobs=np.array(logprobs, dtype=np.float32) if logprobs is not None else None,
        reward=reward,
        span_id=f"s{call_index}",
        response_id=f"r{call_index}",
        model="m",
        policy_version=10 + call_index,
        call_index=call_index,
        agent_name="",
        finish_reason=f"f{call_index}",
        streamed=False,
        forced_positions=ids(forced or []),
    )


def test_transition_rows_are_one_per_call() -> None:
    triplets = [triplet(1, [1, 2, 3, 4], [5], [-2.0], reward=0.5), triplet(0, [1, 2], [3, 4], [-1.0, -0.5])]
    aggregated = rows_from_triplets(triplets, "transition")
    assert aggregated.breaks == []
    first, second = aggregated.rows
    np.testing.assert_array_equal(first.prompt_ids, ids([1, 2]))
    np.testing.assert_array_equal(first.response_ids, ids([3, 4]))
    np.testing.assert_array_equal(first.response_mask, np.array([1, 1], dtype=np.uint8))
    assert first.response_mask.dtype == np.uint8
    assert first.logprobs is not None
    np.testing.assert_array_equal(first.logprobs, np.array([-1.0, -0.5], dtype=np.float32))
    assert (
        first.reward,
        first.turn_index,
        first.call_span_ids,
        first.policy_versions,
        first.finish_reason,
    ) == (
        0.0,
        0,
        ["s0"],
        [10],
        "f0",
    )
    np.testing.assert_array_equal(second.prompt_ids, ids([1, 2, 3, 4]))
    np.testing.assert_array_equal(second.response_ids, ids([5]))
    assert (second.reward, second.turn_index, second.call_span_ids) == (0.5, 1, ["s1"])


def test_trajectory_merges_calls_whose_prompt_extends_the_last_turn() -> None:
    spans = [
        llm("c0", [1, 2, 3], [4, 5], logprobs=[-0.5, -0.25], times=(10, 20), version=7),
        llm(
            "c1", [1, 2, 3, 4, 5, 6, 7], [8], logprobs=[-1.0], times=(30, 40), version=8, finish="tool_calls"
        ),
        llm("c2", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], logprobs=[-0.125, -2.0], times=(50, 60), version=8),
        reward("r", 0.875, times=(70, 71)),
    ]
    result = triplets_from_spans(spans, AdapterConfig(aggregation="trajectory"))
    aggregated = rows_from_triplets(result.triplets, "trajectory")
    assert aggregated.breaks == []
    (row,) = aggregated.rows
    assert row.prompt_ids.dtype == np.int32 and row.response_ids.dtype == np.int32
    assert row.response_mask.dtype == np.uint8
    assert row.prompt_ids.tolist() == [1, 2, 3]
    assert row.response_ids.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert row.response_mask.tolist() == [1, 1, 0, 0, 1, 0, 1, 1]
    assert row.logprobs is not None and row.logprobs.dtype == np.float32
    assert row.logprobs.tolist() == [-0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -0.125, -2.0]
    assert (row.reward, row.turn_index, row.call_span_ids, row.policy_versions, row.finish_reason) == (
        0.875,
        0,
        ["c0", "c1", "c2"],
        [7, 8, 8],
        "stop",
    )
    assert row.trainable_tokens == 5


SYSTEM_AND_TASK = [100, 101, 102]
TOOL_CALL_1, TOOL_RESULT_1 = [200, 201], [300, 301, 302]
TOOL_CALL_2, TOOL_RESULT_2 = [202, 203], [303]
ANSWER = [204, 205, 206]


def tool_conversation(third_prompt_renders_call_2_as: list[int] = TOOL_CALL_2) -> list[Span]:
    """Three calls of one agent: two tool calls, each answered by a tool result, then the answer."""
    second_prompt = SYSTEM_AND_TASK + TOOL_CALL_1 + TOOL_RESULT_1
    third_prompt = second_prompt + third_prompt_renders_call_2_as + TOOL_RESULT_2
    return [
        llm("c0", SYSTEM_AND_TASK, TOOL_CALL_1, logprobs=[-0.5, -0.25], times=(10, 20), finish="tool_calls"),
        llm("c1", second_prompt, TOOL_CALL_2, logprobs=[-1.0, -0.75], times=(30, 40), finish="tool_calls"),
        llm("c2", third_prompt, ANSWER, logprobs=[-0.125, -2.0, -4.0], times=(50, 60)),
        reward("r", 1.0, times=(70, 71)),
    ]


def test_a_tool_conversation_whose_prompts_extend_exactly_is_one_row_with_tool_results_masked_out() -> None:
    result = triplets_from_spans(tool_conversation(), AdapterConfig(aggregation="trajectory"))
    aggregated = rows_from_triplets(result.triplets, "trajectory")
    assert (aggregated.fallback, aggregated.breaks) == (None, [])
    (row,) = aggregated.rows
    assert row.prompt_ids.tolist() == SYSTEM_AND_TASK
    assert row.response_ids.tolist() == TOOL_CALL_1 + TOOL_RESULT_1 + TOOL_CALL_2 + TOOL_RESULT_2 + ANSWER
    # the model's tool calls and answer are trained (1); the tool results are not (0)
    assert row.response_mask.tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1]
    assert row.logprobs is not None
    assert row.logprobs.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -0.75, 0.0, -0.125, -2.0, -4.0]
    assert (row.reward, row.call_span_ids, row.trainable_tokens) == (1.0, ["c0", "c1", "c2"], 7)


def test_a_re_rendered_history_falls_back_to_one_row_per_call_and_names_where_the_ids_differ() -> None:
    re_serialized = [202, 299]  # call 2's tool-call arguments, serialized again differently
    spans = tool_conversation(third_prompt_renders_call_2_as=re_serialized)
    result = triplets_from_spans(spans, AdapterConfig(aggregation="trajectory"))
    aggregated = rows_from_triplets(result.triplets, "trajectory")
    fallback = aggregated.fallback
    assert fallback is not None
    assert (fallback.reason, fallback.call_index, fallback.span_id) == (
        FallbackReason.PROMPT_NOT_EXTENSION,
        2,
        "c2",
    )
    assert fallback.reason == "prompt_not_extension"
    position = len(SYSTEM_AND_TASK + TOOL_CALL_1 + TOOL_RESULT_1) + 1
    assert (fallback.position, fallback.expected_token, fallback.actual_token) == (position, 203, 299)
    assert fallback.detail == (
        f"call 2 (span c2): its prompt differs from call 1's prompt + response at position {position}: "
        "token 299 where 203 was expected"
    )
    assert aggregated.breaks == [1, 2]
    transition = rows_from_triplets(result.triplets, "transition").rows
    assert [row.call_span_ids for row in aggregated.rows] == [["c0"], ["c1"], ["c2"]]
    for row, per_call, call in zip(aggregated.rows, transition, result.triplets, strict=True):
        assert row.prompt_ids.tolist() == call.prompt_ids.tolist() == per_call.prompt_ids.tolist()
        assert row.response_ids.tolist() == call.response_ids.tolist()  # nothing spliced
        assert row.response_mask.all() and row.reward == per_call.reward
    assert [row.reward for row in aggregated.rows] == [0.0, 0.0, 1.0]


def test_a_prompt_that_ends_before_the_earlier_turns_falls_back_with_no_actual_token() -> None:
    triplets = [triplet(0, [1, 2], [3, 4]), triplet(1, [1, 2, 3], [5])]
    fallback = rows_from_triplets(triplets, "trajectory").fallback
    assert fallback is not None
    assert (fallback.call_index, fallback.position, fallback.expected_token, fallback.actual_token) == (
        1,
        3,
        4,
        -1,
    )
    assert "the end of the prompt where 4 was expected" in fallback.detail


def test_each_agent_is_its_own_chain_and_the_earliest_break_of_any_chain_falls_back() -> None:
    def of(agent_name: str, made: Triplet) -> Triplet:
        return dataclasses.replace(made, agent_name=agent_name)

    solver = [of("solver", triplet(0, [1], [2], reward=0.25)), of("solver", triplet(2, [1, 2, 3], [4]))]
    critic = [of("critic", triplet(1, [7], [8])), of("critic", triplet(3, [7, 8, 9], [6], reward=0.5))]
    aggregated = rows_from_triplets(solver + critic, "trajectory")
    assert (aggregated.fallback, aggregated.breaks) == (None, [])
    assert [(r.call_span_ids, r.turn_index, r.reward) for r in aggregated.rows] == [
        (["s0", "s2"], 0, 0.25),
        (["s1", "s3"], 1, 0.5),
    ]
    assert [r.response_mask.tolist() for r in aggregated.rows] == [[1, 0, 1], [1, 0, 1]]
    second_thread = of("critic", triplet(4, [7], [5]))  # the critic starts afresh: not an extension
    aggregated = rows_from_triplets([*solver, *critic, second_thread], "trajectory")
    assert aggregated.fallback is not None and aggregated.fallback.call_index == 4
    assert [r.call_span_ids for r in aggregated.rows] == [["s0"], ["s1"], ["s2"], ["s3"], ["s4"]]
    assert aggregated.breaks == [2, 3, 4]


def test_a_trajectory_row_has_no_logprobs_when_one_of_its_calls_has_none() -> None:
    triplets = [triplet(0, [1], [2], [-1.0]), triplet(1, [1, 2, 3], [4], None)]
    (row,) = rows_from_triplets(triplets, "trajectory").rows
    assert row.logprobs is None
    assert row.response_mask.tolist() == [1, 0, 1]


def test_rows_with_no_trainable_token_are_not_made() -> None:
    triplets = [triplet(0, [1], []), triplet(1, [5], [6])]
    assert [r.call_span_ids for r in rows_from_triplets(triplets, "transition").rows] == [["s1"]]
    trajectory = rows_from_triplets(triplets, "trajectory")
    assert [r.call_span_ids for r in trajectory.rows] == [["s1"]]
    assert trajectory.breaks == [1]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([5, 0, 2, 2], [0, 2, 5]),  # sorted, once each
        ([1, 6, 99], [1]),  # out of range: left out
        (None, []),
        ("0,1", []),  # malformed: ignored
        ([0, -1], []),
        ([0.5], []),
    ],
)
def test_forced_positions_are_read_from_the_span_and_malformed_ones_ignored(
    value: Any, expected: list[int]
) -> None:
    made = llm("c", [1], [2, 3, 4, 5, 6, 7])
    if value is not None:
        made.attributes[semconv.LLM_RESPONSE_FORCED_POSITIONS] = value
    (node,) = TraceTree.from_spans([made]).llm_calls()
    forced = read_call(node, 0).choice0.forced_positions
    assert forced.dtype == np.int32 and forced.tolist() == expected


def test_the_other_choices_forced_positions_come_from_the_recorded_body() -> None:
    body = n_choices_body()
    body["choices"][1]["forced_token_positions"] = [1, 7]
    first, second = other_choices({semconv.LLM_RESPONSE: json.dumps(body)})
    assert (first.forced_positions.tolist(), second.forced_positions.tolist()) == ([1], [])


def test_forced_tokens_are_masked_out_of_transition_rows_with_their_logprobs_kept() -> None:
    triplets = [triplet(0, [1, 2], [3, 4, 5, 6], [-1.0, -0.5, -0.25, -2.0], forced=[0, 1, 3])]
    (row,) = rows_from_triplets(triplets, "transition").rows
    assert row.response_mask.tolist() == [0, 0, 1, 0] and row.trainable_tokens == 1
    assert row.logprobs is not None and row.logprobs.tolist() == [-1.0, -0.5, -0.25, -2.0]


def test_forced_tokens_are_masked_out_of_trajectory_rows() -> None:
    triplets = [
        triplet(0, [1], [2, 3, 4], [-1.0, -0.5, -0.25], forced=[0, 2]),
        triplet(1, [1, 2, 3, 4, 9], [5, 6], [-0.125, -2.0], forced=[1]),
    ]
    (row,) = rows_from_triplets(triplets, "trajectory").rows
    assert row.response_ids.tolist() == [2, 3, 4, 9, 5, 6]
    assert row.response_mask.tolist() == [0, 1, 0, 0, 1, 0]
    assert row.logprobs is not None and row.logprobs.tolist() == [-1.0, -0.5, -0.25, 0.0, -0.125, -2.0]


def test_a_call_whose_every_token_was_forced_makes_no_row() -> None:
    triplets = [triplet(0, [1], [2, 3], forced=[0, 1]), triplet(1, [5], [6], forced=[])]
    assert [r.call_span_ids for r in rows_from_triplets(triplets, "transition").rows] == [["s1"]]
    alone = rows_from_triplets([triplets[0]], "trajectory")
    assert alone.rows == [] and alone.fallback is None


def test_rows_from_triplets_rejects_an_unknown_aggregation() -> None:
    with pytest.raises(ValueError, match="unknown aggregation 'episode'"):
        rows_from_triplets([], "episode")
    assert rows_from_triplets([], "trajectory").rows == []
