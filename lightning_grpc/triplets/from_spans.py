"""A finished attempt's spans -> its triplets (one per trained LLM call), drops and final reward."""

from __future__ import annotations

import re
from collections.abc import Sequence

from lightning_grpc import semconv
from lightning_grpc.types import Span

from .calls import Call, Choice, other_choices, read_call
from .config import DEFAULT_CONFIG, AdapterConfig, compile_agent_match
from .records import Drop, DropReason, RolloutTriplets, Triplet
from .rewards import RewardSpan, final_reward, match_first_occurrence, match_first_sibling, reward_spans
from .tokens import starts_with
from .tree import TraceTree


def triplets_from_spans(spans: Sequence[Span], config: AdapterConfig = DEFAULT_CONFIG) -> RolloutTriplets:
    """The triplets of one attempt's spans, in call order, with every call not trained as a drop.

    Raises ValueError when the spans belong to several rollouts or attempts.
    """
    require_one_attempt(spans)
    tree = TraceTree.from_spans(spans)
    try:
        return _triplets_of_tree(tree, config)
    finally:
        tree.release()


def _triplets_of_tree(tree: TraceTree, config: AdapterConfig) -> RolloutTriplets:
    if config.repair_hierarchy:
        tree.repair_orphan_calls()
    calls = [read_call(node, index) for index, node in enumerate(tree.llm_calls())]
    repeated_calls = [span for span in tree.repeated if span.name == semconv.SPAN_LLM_CALL]
    drops = [
        Drop(DropReason.DUPLICATE_CALL, span.span_id, -1, "span id given twice") for span in repeated_calls
    ]
    candidates = keep_trainable(calls, config, drops)
    kept = drop_retried_duplicates(candidates, drops)
    chosen = choose_continued_choices(kept, drops)
    triplets = [
        triplet_of(call, choice, position)
        for position, (call, choice) in enumerate(zip(kept, chosen, strict=True))
    ]
    rewards = reward_spans(tree, config.reward_dimension)
    final = final_reward(rewards)
    if config.reward_match == "final":
        if triplets and final is not None:
            triplets[-1].reward = final
    else:
        drops.extend(match_rewards(tree, kept, triplets, rewards, config.reward_match))
    drops.sort(key=lambda drop: (drop.call_index < 0, drop.call_index))
    return RolloutTriplets(
        triplets=triplets, drops=drops, reward=final, calls=len(calls) + len(repeated_calls)
    )


def keep_trainable(calls: Sequence[Call], config: AdapterConfig, drops: list[Drop]) -> list[Call]:
    agent_pattern = compile_agent_match(config.agent_match) if config.agent_match is not None else None
    kept = []
    for call in calls:
        drop = reason_not_to_train(call, config, agent_pattern)
        if drop is None:
            kept.append(call)
        else:
            drops.append(drop)
    return kept


def match_rewards(
    tree: TraceTree,
    kept: Sequence[Call],
    triplets: Sequence[Triplet],
    rewards: Sequence[RewardSpan],
    policy: str,
) -> list[Drop]:
    """Give each triplet the reward its policy matches to it; returns the rewards no call took."""
    nodes = [call.node for call in kept]
    if policy == "first_occurrence":
        rewarded, unmatched = match_first_occurrence(nodes, rewards)
    else:
        rewarded, unmatched = match_first_sibling(tree, nodes, rewards)
    for triplet in triplets:
        triplet.reward = rewarded.get(triplet.span_id)
    return [
        Drop(
            DropReason.UNMATCHED_REWARD,
            reward.node.span_id,
            -1,
            f"reward {reward.value!r}: no earlier finished unrewarded call",
        )
        for reward in unmatched
    ]


def require_one_attempt(spans: Sequence[Span]) -> None:
    """Raise ValueError unless all spans name (at most) one rollout and one attempt."""
    rollouts: set[str] = set()
    attempts: set[str] = set()
    for span in spans:
        rollout_id, attempt_id = semconv.attribution(span.attributes)
        rollouts.add(span.rollout_id or rollout_id)
        attempts.add(span.attempt_id or attempt_id)
    rollouts.discard("")
    attempts.discard("")
    for what, ids in (("rollouts", rollouts), ("attempts", attempts)):
        if len(ids) > 1:
            named = ", ".join(sorted(ids)[:4]) + (", ..." if len(ids) > 4 else "")
            raise ValueError(
                f"spans of {len(ids)} {what} given ({named}); pass the spans of one attempt only (the latest)"
            )


def reason_not_to_train(
    call: Call, config: AdapterConfig, agent_pattern: re.Pattern[str] | None
) -> Drop | None:
    """Why a call is not trained, checked in this order: judge call, other agent, error, missing ids."""
    if config.exclude_calls_under_reward and call.in_reward_scope:
        return dropped(call, DropReason.JUDGE_CALL, "made inside a reward scope")
    if agent_pattern is not None:
        if not call.agent_name:
            return dropped(call, DropReason.OTHER_AGENT, "no agent above the call")
        if agent_pattern.search(call.agent_name) is None:
            return dropped(
                call, DropReason.OTHER_AGENT, f"agent {call.agent_name!r} does not match agent_match"
            )
    if call.error is not None:
        return dropped(call, DropReason.CALL_ERROR, call.error[:200])
    missing = missing_ids(call)
    if missing:
        return dropped(call, DropReason.NO_TOKEN_IDS, missing)
    return None


def missing_ids(call: Call) -> str:
    """What is wrong with a call's ids ("" when both prompt and response ids are there)."""
    for what, ids, key in (
        ("prompt", call.prompt_ids, semconv.LLM_PROMPT_TOKEN_IDS),
        ("response", call.choice0.response_ids, semconv.LLM_RESPONSE_TOKEN_IDS),
    ):
        if ids is None:
            value = call.node.attributes.get(key)
            return f"{what} ids missing" if value is None else f"{what} ids malformed"
        if len(ids) == 0:
            return f"{what} ids empty"
    return ""


def dropped(call: Call, reason: DropReason, detail: str) -> Drop:
    return Drop(reason, call.span_id, call.index, detail)


def drop_retried_duplicates(calls: Sequence[Call], drops: list[Drop]) -> list[Call]:
    """Keep the last of calls with identical prompt ids (or the same response id); the earlier ones are
    retries, dropped as DUPLICATE_CALL."""
    by_prompt: dict[bytes, Call] = {}
    by_response: dict[str, Call] = {}
    kept: list[Call] = []
    for call in reversed(calls):
        assert call.prompt_ids is not None
        key = call.prompt_ids.tobytes()
        if key in by_prompt:
            later = by_prompt[key]
            drops.append(
                dropped(call, DropReason.DUPLICATE_CALL, f"retry of call {later.index} (same prompt ids)")
            )
            continue
        if call.response_id and call.response_id in by_response:
            later = by_response[call.response_id]
            drops.append(dropped(call, DropReason.DUPLICATE_CALL, f"same response id as call {later.index}"))
            continue
        by_prompt[key] = call
        if call.response_id:
            by_response[call.response_id] = call
        kept.append(call)
    kept.reverse()
    return kept


def choose_continued_choices(calls: Sequence[Call], drops: list[Drop]) -> list[Choice]:
    """The choice to train of each call: for ``n > 1``, the choice a later call's prompt continues (the first
    later call that continues one), else choice 0; the others are dropped as UNUSED_CHOICE."""
    chosen = []
    for position, call in enumerate(calls):
        options = [call.choice0, *other_choices(call.node.attributes)]
        if len(options) == 1:
            chosen.append(call.choice0)
            continue
        pick = continued_choice(call, options, calls[position + 1 :]) or call.choice0
        for option in options:
            if option is not pick:
                drops.append(
                    dropped(
                        call,
                        DropReason.UNUSED_CHOICE,
                        f"choice {option.index} of {len(options)}, trained {pick.index}",
                    )
                )
        chosen.append(pick)
    return chosen


def continued_choice(call: Call, options: Sequence[Choice], later_calls: Sequence[Call]) -> Choice | None:
    assert call.prompt_ids is not None
    for later in later_calls:
        assert later.prompt_ids is not None
        for option in options:
            ids = option.response_ids
            if ids is not None and len(ids) and starts_with(later.prompt_ids, call.prompt_ids, ids):
                return option
    return None


def triplet_of(call: Call, choice: Choice, position: int) -> Triplet:
    assert call.prompt_ids is not None and choice.response_ids is not None
    return Triplet(
        prompt_ids=call.prompt_ids,
        response_ids=choice.response_ids,
        logprobs=choice.logprobs,
        reward=None,
        span_id=call.span_id,
        response_id=call.response_id,
        model=call.model,
        policy_version=call.policy_version,
        call_index=position,
        agent_name=call.agent_name,
        finish_reason=choice.finish_reason,
        streamed=call.streamed,
        forced_positions=choice.forced_positions,
        temperature=call.temperature,
        top_p=call.top_p,
    )
