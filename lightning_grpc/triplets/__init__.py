"""A finished attempt's spans -> triplets -> training rows. Plain Python and numpy (no gRPC, store or torch).

Usage::

    result = triplets_from_spans(spans, AdapterConfig(aggregation="trajectory"))
    batch = rows_from_triplets(result.triplets, "trajectory")

Inputs are :class:`lightning_grpc.types.Span` objects of one attempt (the latest; spans of several
rollouts or attempts raise ValueError), attributes decoded. Span and attribute names come from
:mod:`lightning_grpc.semconv`.

**Calls.** The tokens' source of truth is the proxy's span per LLM call (``semconv.SPAN_LLM_CALL``):
``LLM_PROMPT_TOKEN_IDS``, ``LLM_RESPONSE_TOKEN_IDS``, ``LLM_RESPONSE_LOGPROBS`` (kept only when finite and
one per response token), ``LLM_POLICY_VERSION`` (-1 when absent), ``LLM_RESPONSE_FORCED_POSITIONS`` (the
response positions a grammar forced, e.g. the frame of a forced tool call: ``Triplet.forced_positions``,
sorted; malformed values ignored, positions out of range left out; for ``n > 1`` the other choices' come
from ``choices[i].forced_token_positions``), ``LLM_REQUEST_TEMPERATURE`` / ``LLM_REQUEST_TOP_P`` (what the
engine sampled with: ``Triplet.temperature`` / ``top_p``, None when the span does not say; a row counts an
unknown temperature as 1.0, the engine default). Call order: start time, then sequence id.
Ids are int32 numpy arrays, log-probs float32.

**Trace tree** (:mod:`.tree`). Children in call order; a parent id naming no given span becomes a virtual
node holding its children; several tops hang under a virtual root; parent cycles are cut. With
``repair_hierarchy`` an LLM-call span with no known parent moves under the tightest real span that encloses
it in time (not an LLM call, not its own descendant; least slack, then deepest, then latest).

**Drops** (:class:`Drop`: reason, span id, the call's index among all LLM calls in call order or -1, detail).
Each LLM-call span is either a triplet or dropped once, checked in this order:

* ``JUDGE_CALL``: made under a reward scope (a span carrying a reward, the reward span, or an operation
  named ``semconv.SPAN_REWARD``) when ``exclude_calls_under_reward``;
* ``OTHER_AGENT``: with ``agent_match``, no agent above the call or its agent's name does not match
  (``re.search``). The agent of a call is the nearest ancestor naming one (``semconv.read_agent_name``:
  ``lightning.agent.name``, else ``agent.name``, else an operation span's name); "" when none;
* ``CALL_ERROR``: ``LLM_ERROR`` set or span status ERROR;
* ``NO_TOKEN_IDS``: prompt or response ids missing, empty or malformed;
* ``DUPLICATE_CALL``: retries, i.e. calls with the same prompt ids (or the same response id) as a later
  call that passed the checks above: the last one is trained. A span id given twice is also dropped so
  (call index -1);

so ``calls == len(triplets) + drops whose reason is in CALL_DROP_REASONS``. Other drops:
``UNUSED_CHOICE`` (``n > 1``: choice 0 is the recorded one, the others are read from the ``LLM_RESPONSE``
JSON, ``choices[i].token_ids``; the choice the first later trained call's prompt continues is trained,
else choice 0; one drop per other choice) and ``UNMATCHED_REWARD`` (the reward span's id, -1).

**Rewards.** Reward spans are those with a value of ``reward_dimension`` (None: each span's primary
dimension), in call order; :attr:`RolloutTriplets.reward` is the last one's value (float64, exact), None
without any. ``reward_match="final"``: that reward goes to the last triplet. ``"first_occurrence"``:
each reward span goes to the latest trained call before it that had finished when it started and has no
reward yet (call order decides when a time is missing). ``"first_sibling"``: the same among the reward
span's siblings only. Triplets without a reward have ``reward=None``.

**Rows** (:func:`rows_from_triplets`). ``"transition"``: one row per triplet, reward its reward or 0.0.
In either mode, a response token a grammar forced (``Triplet.forced_positions``) has mask 0 (not the policy's
choice; its logprob stays as recorded), so a call whose every token was forced trains nothing.
``"trajectory"``: the calls of each agent (``Triplet.agent_name``; "" when none names one) form one chain in
call order, and a chain is one row when every call's prompt starts with the previous call's prompt +
response, token for token: the prompt tokens after them (the observation: tool outputs, environment text)
join the response with mask 0 and logprob 0.0, then the new response with mask 1 (the model's own tokens);
the reward is the sum of the calls' rewards. When any call does not extend its chain (an agent framework
re-rendered the history), the whole rollout falls back to one row per call, as ``"transition"`` makes them,
rather than train on a spliced sequence: :attr:`Aggregated.fallback` gives the reason
(:class:`FallbackReason`, ``"prompt_not_extension"``), the first such call, the first position where its
prompt differs from the earlier turns and the two token ids there. A row has one sampling temperature
(``Row.temperature``, the learner's for its log-probs): a call sampled at another temperature than its
chain's first makes the rollout fall back the same way (``"temperature_differs"``, position and tokens -1);
:attr:`Aggregated.breaks` then holds the
call_index of every call that starts a row but is not its chain's first (empty when nothing fell back).
Threads: interleaved calls of two agents make two rows; two threads of one agent (a sub-conversation that
starts afresh) cannot be told from a re-rendered history, so they fall back (``agent_match`` trains one
agent; judge calls are excluded before). A row's logprobs are None when any of its calls has none. Rows
with no trainable token are not made (the caller counts them from the triplets that appear in no row's
``call_span_ids``).
"""

from .config import AGGREGATIONS, REWARD_MATCHES, AdapterConfig
from .from_spans import triplets_from_spans
from .records import CALL_DROP_REASONS, Drop, DropReason, Fallback, FallbackReason, RolloutTriplets, Triplet
from .rows import Aggregated, Row, rows_from_triplets

__all__ = [
    "AGGREGATIONS",
    "CALL_DROP_REASONS",
    "REWARD_MATCHES",
    "AdapterConfig",
    "Aggregated",
    "Drop",
    "DropReason",
    "Fallback",
    "FallbackReason",
    "RolloutTriplets",
    "Row",
    "Triplet",
    "rows_from_triplets",
    "triplets_from_spans",
]
