"""TrainerClient: submit GRPO groups, pull whole-group training batches as numpy arrays (or torch tensors),
report steps and watch training."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import grpc
import numpy as np

from lightning_grpc import convert
from lightning_grpc import types as t
from lightning_grpc.batching import (
    BatchOptions,
    BatchRollout,
    GroupSample,
    Layout,
    RowInfo,
    RunInterruption,
    TrainingEvent,
)
from lightning_grpc.batching.batches import row_infos
from lightning_grpc.batching.core import GroupCounts, TrainerStatus
from lightning_grpc.batching.options import Aggregation, FailurePolicy, PromptOverflow, RewardMatch
from lightning_grpc.batching.tensors import (
    INDEX_ARRAYS,
    Ragged,
    concat,
    fill_padded,
    pad,
    padded_outputs,
)
from lightning_grpc.convert.trainer import aggregation_fallback_from_pb
from lightning_grpc.triplets import Drop, Fallback, Triplet
from lightning_grpc.v1 import trainer_service_pb2 as pb
from lightning_grpc.v1 import trainer_service_pb2_grpc as pb_grpc

from .arguments import enum_member
from .channel import call_metadata, make_channel
from .config import ClientConfig, RetryConfig, TlsConfig
from .errors import from_rpc_error
from .store import _DEFAULTS, client_config


@dataclass
class SubmittedGroup:
    """A group submitted by :meth:`TrainerClient.submit_groups`: its id and its rollouts' ids."""

    group_id: str
    rollout_ids: list[str]


@dataclass
class TrainingBatch:
    """One batch of whole groups, with verl's padded arrays.

    ``arrays`` holds prompts, responses, input_ids, attention_mask, position_ids, response_mask,
    token_level_scores, rollout_log_probs (when recorded) and the per-row arrays (rollout_index,
    rows_per_rollout, rollout_rewards, scores, has_rollout_log_probs, prompt/response lengths, and
    ``temperatures``: float32, the sampling temperature of each row's calls as the proxy recorded them, 1.0
    when a call's span does not say; absent from a server before it).
    ``uid`` is each row's group id (GRPO's grouping), ``rollout_ids`` each row's rollout.
    """

    batch_id: str
    group_ids: list[str]
    rollouts: list[BatchRollout]
    arrays: dict[str, np.ndarray]
    drops: dict[str, int]
    carried_over_groups: int
    closed_by_deadline: bool
    #: Row restarts in the rollouts whose trajectory rows fell back to one row per call.
    trajectory_breaks: int
    #: TRAJECTORY aggregation: rollouts whose rows fell back to one row per call, by reason
    #: (``"prompt_not_extension"``: a later prompt was not a token-exact extension of the earlier turns).
    fallbacks: dict[str, int] = field(default_factory=dict)
    #: The compact form the batch travelled in (RAGGED layout), else None.
    ragged: Ragged | None = None
    uid: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    rollout_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    messages: Sequence[pb.GetBatchResponse] = ()
    #: The span id and policy version of every call of every row, row after row.
    call_span_ids: list[str] = field(default_factory=list)
    call_policy_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def wire_bytes(self) -> int:
        """Bytes of the messages received for this batch."""
        return sum(m.ByteSize() for m in self.messages)

    @cached_property
    def rows(self) -> list[RowInfo]:
        """Each row's rollout index, turn index, calls (span ids and policy versions), truncated and filled."""
        return row_infos(self.arrays, self.call_span_ids, self.call_policy_versions.tolist())

    def __len__(self) -> int:
        return int(self.arrays["rollout_index"].shape[0])

    def tensors(self, device: Any = None) -> dict[str, Any]:
        """The arrays as torch tensors; on the CPU they share the arrays' memory (no copy)."""
        import torch

        out = {}
        for name, array in self.arrays.items():
            tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
            out[name] = tensor if device is None else tensor.to(device)
        return out


@dataclass
class RolloutTripletReport:
    """What training makes of one rollout: its triplets, rows and everything left out, with reasons."""

    rollout_id: str
    attempt_id: str
    status: t.RolloutStatus
    reward: float | None
    calls: int
    triplets: list[Triplet]
    drops: list[Drop]
    rows: list[dict[str, Any]]
    #: TRAJECTORY aggregation: why the rows fell back to one row per call (the first call whose prompt did
    #: not extend the earlier turns, where the ids first differ); None when they did not.
    aggregation_fallback: Fallback | None = None


def _ids(values: Any) -> np.ndarray:
    return np.fromiter(values, dtype=np.int32, count=len(values))


def _batch_options(
    options: BatchOptions | None,
    *,
    aggregation: Aggregation | str | int | None,
    reward_match: RewardMatch | str | int | None,
    reward_dimension: str | None,
    agent_match: str | None,
    failure_policy: FailurePolicy | str | int | None,
    fill_reward: float | None,
    min_policy_version: int | None,
    pad_token_id: int | None,
    max_prompt_length: int | None,
    max_response_length: int | None,
    prompt_overflow: PromptOverflow | str | int | None,
    layout: Layout | str | int | None,
    max_chunk_bytes: int | None,
    exclude_log_probs: bool | None,
    include_calls_under_reward: bool | None,
) -> BatchOptions:
    """``options`` when given, else options from the values given (None: the option's default), checked."""
    if options is not None:
        return options
    values: dict[str, object] = {
        "aggregation": aggregation,
        "reward_match": reward_match,
        "reward_dimension": reward_dimension,
        "agent_match": agent_match,
        "failure_policy": failure_policy,
        "fill_reward": fill_reward,
        "min_policy_version": min_policy_version,
        "pad_token_id": pad_token_id,
        "max_prompt_length": max_prompt_length,
        "max_response_length": max_response_length,
        "prompt_overflow": prompt_overflow,
        "layout": layout,
        "max_chunk_bytes": max_chunk_bytes,
        "exclude_log_probs": exclude_log_probs,
        "include_calls_under_reward": include_calls_under_reward,
    }
    return BatchOptions.checked("options", **{name: v for name, v in values.items() if v is not None})


def _triplet(m: pb.Triplet) -> Triplet:
    return Triplet(
        prompt_ids=_ids(m.prompt_ids),
        response_ids=_ids(m.response_ids),
        logprobs=np.fromiter(m.log_probs, dtype=np.float32, count=len(m.log_probs)) if m.log_probs else None,
        reward=m.reward if m.HasField("reward") else None,
        span_id=m.span_id,
        response_id=m.response_id,
        model=m.model,
        policy_version=m.policy_version,
        call_index=m.call_index,
        agent_name=m.agent_name,
        finish_reason=m.finish_reason,
        streamed=m.streamed,
        forced_positions=np.fromiter(m.forced_positions, dtype=np.int32, count=len(m.forced_positions)),
        temperature=m.temperature if m.HasField("temperature") else None,
        top_p=m.top_p if m.HasField("top_p") else None,
    )


class TrainerClient:
    """Async client of the TrainerService (same channel options, TLS and token as :class:`StoreClient`).

    Create it inside the event loop that uses it. Every method raises a subclass of
    :class:`lightning_grpc.errors.LightningError` on failure.

    Args:
        target: The server's address (``host:port``), or a whole :class:`ClientConfig` (then the
            other arguments are ignored).
        token: The bearer token sent with every call.
        tls: TLS settings; None for a plaintext channel.
        retry: The retry policy of the idempotent methods; None turns retries off.
        timeout: The default deadline of a call, in seconds (long-polls add their wait on top).
        gzip: Compress messages with gzip.
        keepalive_seconds: The interval of the channel's keepalive pings.
    """

    def __init__(
        self,
        target: str | ClientConfig = _DEFAULTS.target,
        *,
        token: str | None = _DEFAULTS.token,
        tls: TlsConfig | None = _DEFAULTS.tls,
        retry: RetryConfig | None = _DEFAULTS.retry,
        timeout: float = _DEFAULTS.timeout,
        gzip: bool = _DEFAULTS.gzip,
        keepalive_seconds: float = _DEFAULTS.keepalive_seconds,
    ) -> None:
        self.config = client_config(
            target,
            token=token,
            tls=tls,
            retry=retry,
            timeout=timeout,
            gzip=gzip,
            keepalive_seconds=keepalive_seconds,
        )
        self._channel = make_channel(self.config)
        self._stub = pb_grpc.TrainerServiceStub(self._channel)
        self._metadata = call_metadata(self.config)

    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> TrainerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def stub(self) -> pb_grpc.TrainerServiceStub:
        """The raw generated stub, for anything this class does not wrap."""
        return self._stub

    async def _call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, method)(
                request, timeout=self.config.timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    # ------------------------------------------------------------ groups
    async def submit_groups(
        self,
        samples: Sequence[Any],
        group_size: int,
        *,
        mode: t.RolloutMode | str = "train",
        resources_id: str = "",
        config: t.RolloutConfig | None = None,
        step: int = 0,
    ) -> list[SubmittedGroup]:
        """Queue ``group_size`` rollouts per sample, one GRPO group per sample.

        Retried on UNAVAILABLE: group ids are chosen here when a sample has none, so a retried call
        creates nothing twice.

        Args:
            samples: Task inputs, or :class:`GroupSample` objects (input, group id, metadata).
            group_size: The rollouts of each group.
            mode: train, val or test (a :class:`RolloutMode` or its name).
            resources_id: The resources set the rollouts run with.
            config: Timeouts and retries of the rollouts' attempts.
            step: The training step the groups are for.

        Returns:
            Each group's id and rollout ids, in the order of ``samples``.

        Raises:
            InvalidArgumentError: A refused sample, group size, mode or config.
            NotFoundError: ``resources_id`` names no resources set.
        """
        request = pb.SubmitGroupsRequest(
            group_size=group_size,
            mode=int(enum_member(t.RolloutMode, mode)),  # type: ignore[arg-type]
            resources_id=resources_id,
            step=step,
        )
        for sample in samples:
            s = sample if isinstance(sample, GroupSample) else GroupSample(input=sample)
            m = request.samples.add(group_id=s.group_id or f"g-{uuid.uuid4().hex[:16]}")
            convert.python_to_value(s.input, m.input, "input")
            if s.metadata:
                convert.dict_to_struct(s.metadata, m.metadata)
        if config is not None:
            convert.config_to_pb(config, request.config)
        resp = await self._call("SubmitGroups", request)
        return [SubmittedGroup(g.group_id, list(g.rollout_ids)) for g in resp.groups]

    # ------------------------------------------------------------ batches
    async def get_batch(
        self,
        min_groups: int = 1,
        max_groups: int = 0,
        *,
        wait: float = 0.0,
        mode: t.RolloutMode | str = "train",
        options: BatchOptions | None = None,
        request_id: str = "",
        aggregation: Aggregation | str | int | None = None,
        reward_match: RewardMatch | str | int | None = None,
        reward_dimension: str | None = None,
        agent_match: str | None = None,
        failure_policy: FailurePolicy | str | int | None = None,
        fill_reward: float | None = None,
        min_policy_version: int | None = None,
        pad_token_id: int | None = None,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_overflow: PromptOverflow | str | int | None = None,
        layout: Layout | str | int | None = None,
        max_chunk_bytes: int | None = None,
        exclude_log_probs: bool | None = None,
        include_calls_under_reward: bool | None = None,
    ) -> TrainingBatch:
        """A batch of whole groups: waits up to ``wait`` s for ``min_groups``, takes at most ``max_groups``.

        The options are a :class:`BatchOptions`, or its fields as keywords (``pad_token_id=...``,
        ``failure_policy="drop_group"``, ``aggregation="trajectory"``, ...; None: the field's default),
        used only when ``options`` is None. Retried on UNAVAILABLE: a request id is sent along
        (``request_id``, or one chosen here), and a retry with the same id returns the same groups.

        Args:
            min_groups: The fewest groups to wait for.
            max_groups: The most groups to take (0: every ready one).
            wait: How long to wait for ``min_groups``, in seconds.
            mode: The mode of the groups (train, val or test).
            options: All the batch options at once.
            request_id: The id that makes a repeated request return the same batch.
            aggregation: transition (a row per call) or trajectory (a row per agent's chain of calls;
                one row per call when a prompt does not extend the earlier turns).
            reward_match: Which reward span a call takes: final, first_occurrence or first_sibling.
            reward_dimension: The reward dimension to train on ("": the main one).
            agent_match: A regular expression of the agents whose calls are trained.
            failure_policy: What a failed rollout does: drop_rollout, drop_group or fill.
            fill_reward: The reward of failed rollouts under the fill policy.
            min_policy_version: Drop calls made by an older policy.
            pad_token_id: The token id of the padding.
            max_prompt_length: Cut or drop longer prompts (0: no limit).
            max_response_length: Cut longer responses (0: no limit).
            prompt_overflow: What a long prompt does: drop or truncate_left.
            layout: How the batch travels: ragged or padded.
            max_chunk_bytes: The largest message of the stream.
            exclude_log_probs: Leave the recorded log probabilities out.
            include_calls_under_reward: Also train calls made under a reward span.

        Returns:
            The batch, its arrays padded as verl expects them.

        Raises:
            InvalidArgumentError: A refused option, group count or wait.
            DeadlineExceededError: The call outlived its deadline.
        """
        options = _batch_options(
            options,
            aggregation=aggregation,
            reward_match=reward_match,
            reward_dimension=reward_dimension,
            agent_match=agent_match,
            failure_policy=failure_policy,
            fill_reward=fill_reward,
            min_policy_version=min_policy_version,
            pad_token_id=pad_token_id,
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
            prompt_overflow=prompt_overflow,
            layout=layout,
            max_chunk_bytes=max_chunk_bytes,
            exclude_log_probs=exclude_log_probs,
            include_calls_under_reward=include_calls_under_reward,
        )
        request = pb.GetBatchRequest(
            request_id=request_id or f"b-{uuid.uuid4().hex[:16]}",
            mode=int(enum_member(t.RolloutMode, mode)),  # type: ignore[arg-type]
            min_groups=min_groups,
            max_groups=max_groups,
        )
        convert.float_to_duration(wait, request.wait)
        convert.batch_options_to_pb(options, request.options)
        assembler = BatchAssembler()  # chunks are padded as they arrive
        try:
            call = self._stub.GetBatch(request, timeout=self.config.timeout + wait, metadata=self._metadata)
            async for message in call:
                assembler.add(message)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return assembler.finish()

    async def report_step(
        self,
        step: int,
        policy_version: int,
        metrics: Mapping[str, float] | None = None,
        *,
        run_id: str = "",
        interruptions: Sequence[RunInterruption] = (),
    ) -> TrainingEvent:
        """Report a finished training step and the policy version it produced.

        Retried on UNAVAILABLE: a step reported again with the same content (interruptions included) is
        answered with the stored event (with other content it is recorded anew: a run resumed from a
        checkpoint).

        Args:
            step: The step number.
            policy_version: The policy version after the step.
            metrics: The step's metrics by name.
            run_id: The training run ("": the default run).
            interruptions: The run's interruptions recovered since its previous report (a process that
                died, the cause, how the run recovered and how long it took), oldest first; kept with the
                step's event and shown by ``trainer status`` and the dashboard.

        Returns:
            The stored event.

        Raises:
            InvalidArgumentError: A refused step, version, metric or interruption (the field is named,
                e.g. ``interruptions[0].process``).
        """
        request = pb.ReportStepRequest(run_id=run_id, step=step, policy_version=policy_version)
        request.metrics.update({k: float(v) for k, v in (metrics or {}).items()})
        for interruption in interruptions:
            convert.run_interruption_to_pb(interruption, request.interruptions.add())
        resp = await self._call("ReportStep", request)
        return convert.training_event_from_pb(resp.event)

    async def watch_training(
        self, run_id: str = "", *, after_sequence: int = 0, follow: bool = False
    ) -> AsyncIterator[TrainingEvent]:
        """Reported steps after ``after_sequence``; with ``follow``, new ones as they are reported.

        Not retried (a stream): on UNAVAILABLE call again with the last event's sequence.

        Args:
            run_id: The training run ("": the default run).
            after_sequence: Start after the event of this sequence number.
            follow: Keep the stream open for new events (no deadline).

        Yields:
            The training events, in order.

        Raises:
            InvalidArgumentError: A refused sequence number.
        """
        request = pb.WatchTrainingRequest(run_id=run_id, after_sequence=after_sequence, follow=follow)
        try:
            call = self._stub.WatchTraining(
                request, timeout=None if follow else self.config.timeout, metadata=self._metadata
            )
            async for message in call:
                yield convert.training_event_from_pb(message.event)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def status(self) -> TrainerStatus:
        """The trainer's groups by mode, drops, batches and policy version. Retried on UNAVAILABLE.

        Returns:
            The trainer's status.
        """
        resp = await self._call("GetTrainerStatus", pb.GetTrainerStatusRequest())
        return TrainerStatus(
            groups=[
                GroupCounts(t.RolloutMode(g.mode), g.pending, g.ready, g.carried_over, g.consumed)
                for g in resp.groups
            ],
            drops={d.reason: d.count for d in resp.drops},
            batches=resp.batches,
            rows=resp.rows,
            policy_version=resp.policy_version,
            last_event=convert.training_event_from_pb(resp.last_event)
            if resp.HasField("last_event")
            else None,
            fallbacks={f.reason: f.count for f in resp.fallbacks},
        )

    async def triplets(
        self,
        rollout_id: str,
        options: BatchOptions | None = None,
        *,
        aggregation: Aggregation | str | int | None = None,
        reward_match: RewardMatch | str | int | None = None,
        reward_dimension: str | None = None,
        agent_match: str | None = None,
        failure_policy: FailurePolicy | str | int | None = None,
        fill_reward: float | None = None,
        min_policy_version: int | None = None,
        pad_token_id: int | None = None,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_overflow: PromptOverflow | str | int | None = None,
        layout: Layout | str | int | None = None,
        max_chunk_bytes: int | None = None,
        exclude_log_probs: bool | None = None,
        include_calls_under_reward: bool | None = None,
    ) -> RolloutTripletReport:
        """The triplets of a rollout's latest attempt, its rows, and the reasons for anything not trained.

        The options are those of :meth:`get_batch` (a :class:`BatchOptions`, or its fields as keywords,
        used only when ``options`` is None). Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            options: All the batch options at once.
            aggregation: transition (a row per call) or trajectory (a row per agent's chain of calls;
                one row per call when a prompt does not extend the earlier turns).
            reward_match: Which reward span a call takes: final, first_occurrence or first_sibling.
            reward_dimension: The reward dimension to train on ("": the main one).
            agent_match: A regular expression of the agents whose calls are trained.
            failure_policy: What a failed rollout does: drop_rollout, drop_group or fill.
            fill_reward: The reward of failed rollouts under the fill policy.
            min_policy_version: Drop calls made by an older policy.
            pad_token_id: The token id of the padding.
            max_prompt_length: Cut or drop longer prompts (0: no limit).
            max_response_length: Cut longer responses (0: no limit).
            prompt_overflow: What a long prompt does: drop or truncate_left.
            layout: How a batch travels: ragged or padded.
            max_chunk_bytes: The largest message of a batch stream.
            exclude_log_probs: Leave the recorded log probabilities out.
            include_calls_under_reward: Also train calls made under a reward span.

        Returns:
            The report: triplets, rows and drops with their reasons.

        Raises:
            NotFoundError: No such rollout.
            InvalidArgumentError: A refused option.
        """
        request = pb.GetTripletsRequest(rollout_id=rollout_id)
        chosen = _batch_options(
            options,
            aggregation=aggregation,
            reward_match=reward_match,
            reward_dimension=reward_dimension,
            agent_match=agent_match,
            failure_policy=failure_policy,
            fill_reward=fill_reward,
            min_policy_version=min_policy_version,
            pad_token_id=pad_token_id,
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
            prompt_overflow=prompt_overflow,
            layout=layout,
            max_chunk_bytes=max_chunk_bytes,
            exclude_log_probs=exclude_log_probs,
            include_calls_under_reward=include_calls_under_reward,
        )
        convert.batch_options_to_pb(chosen, request.options)
        resp = await self._call("GetTriplets", request)
        rows = [
            {
                "turn_index": r.turn_index,
                "prompt_tokens": p,
                "response_tokens": n,
                "trainable_tokens": k,
                "policy_versions": list(r.policy_versions),
                "has_log_probs": r.has_log_probs,
                "call_span_ids": list(r.call_span_ids),
            }
            for r, p, n, k in zip(
                resp.rows,
                resp.row_prompt_lengths,
                resp.row_response_lengths,
                resp.row_trainable_tokens,
                strict=True,
            )
        ]
        return RolloutTripletReport(
            rollout_id=resp.rollout_id,
            attempt_id=resp.attempt_id,
            status=t.RolloutStatus(resp.status),
            reward=resp.reward if resp.HasField("reward") else None,
            calls=resp.calls,
            triplets=[_triplet(m) for m in resp.triplets],
            drops=[Drop(d.reason, d.span_id, d.call_index, d.detail) for d in resp.drops],
            rows=rows,
            aggregation_fallback=aggregation_fallback_from_pb(resp.aggregation_fallback),
        )


_ROLLOUT_STATUS = {int(s): s for s in t.RolloutStatus}


class BatchAssembler:
    """A batch put together from its stream, message by message.

    With the RAGGED layout each chunk is padded into the batch's arrays as soon as it arrives (the header
    gives the widths), while the server builds and sends the next one.
    """

    def __init__(self) -> None:
        self.messages: list[pb.GetBatchResponse] = []
        self._parts: list[Ragged] = []
        self._chunks: list[dict[str, np.ndarray]] = []
        self._out: dict[str, np.ndarray] | None = None
        self._padded_rows = 0

    def add(self, message: pb.GetBatchResponse) -> None:
        """Take the next message of the stream (the header first).

        Args:
            message: The message.

        Raises:
            ValueError: The stream does not start with its header.
        """
        if not self.messages and not message.HasField("header"):
            raise ValueError("a batch stream starts with its header")
        self.messages.append(message)
        header = self.messages[0].header
        chunk = {
            name: convert.tensor_from_pb(tensor, f"tensors[{name!r}]")
            for name, tensor in message.tensors.items()
        }
        if header.layout == pb.BATCH_LAYOUT_PADDED:
            self._chunks.append(chunk)
            return
        part = Ragged.from_arrays(chunk)
        self._parts.append(part)
        widths = (header.prompt_length, header.response_length)
        if part.rows and (
            widths[0] < int(part.prompt_lengths.max()) or widths[1] < int(part.response_lengths.max())
        ):
            return  # a server that does not give the widths: padded once every chunk is in
        if self._out is None:
            self._out = padded_outputs(
                header.row_count, *widths, log_probs=part.rollout_log_probs is not None
            )
        fill_padded(part, self._out, *widths, header.pad_token_id, start=message.row_offset)
        self._padded_rows += part.rows

    def finish(self) -> TrainingBatch:
        """The batch, once every message of the stream is in.

        Returns:
            The batch.

        Raises:
            ValueError: No header, or fewer chunks than the header announced.
        """
        messages = self.messages
        if not messages:
            raise ValueError("a batch stream starts with its header")
        header = messages[0].header
        if len(messages) != header.chunk_count:
            raise ValueError(f"the batch stream ended after {len(messages)} of {header.chunk_count} chunks")
        ragged = None
        if header.layout == pb.BATCH_LAYOUT_PADDED:
            arrays = {name: np.concatenate([c[name] for c in self._chunks]) for name in self._chunks[0]}
            for name in INDEX_ARRAYS:
                arrays[name] = arrays[name].astype(np.int64)
        else:
            ragged = self._parts[0] if len(self._parts) == 1 else concat(self._parts)
            if self._out is not None and self._padded_rows == ragged.rows == header.row_count:
                arrays = dict(self._out)
                for name, array in ragged.row_arrays().items():  # small: copied, so every array is writable
                    arrays[name] = np.array(array)
            else:  # not padded on the way (no widths in the header, or chunks that disagree with them)
                arrays = pad(ragged, pad_token_id=header.pad_token_id)
        status = _ROLLOUT_STATUS
        rollouts = [
            BatchRollout(
                r.rollout_id,
                r.attempt_id,
                r.group_id,
                status.get(r.status) or t.RolloutStatus(r.status),
                r.reward,
                r.filled,
                r.row_count,
            )
            for r in header.rollouts
        ]
        index = arrays["rollout_index"]
        return TrainingBatch(
            batch_id=header.batch_id,
            group_ids=list(header.group_ids),
            rollouts=rollouts,
            arrays=arrays,
            drops={d.reason: d.count for d in header.drops},
            carried_over_groups=header.carried_over_groups,
            closed_by_deadline=header.closed_by_deadline,
            trajectory_breaks=header.trajectory_breaks,
            fallbacks={f.reason: f.count for f in header.fallbacks},
            messages=messages,
            ragged=ragged,
            call_span_ids=[s for m in messages for s in m.call_span_ids],
            call_policy_versions=np.fromiter(
                (v for m in messages for v in m.call_policy_versions),
                dtype=np.int64,
                count=sum(len(m.call_policy_versions) for m in messages),
            ),
            uid=np.array([r.group_id for r in rollouts], dtype=object)[index]
            if rollouts
            else np.zeros(0, object),
            rollout_ids=np.array([r.rollout_id for r in rollouts], dtype=object)[index]
            if rollouts
            else np.zeros(0, object),
        )


def batch_from_messages(messages: Sequence[pb.GetBatchResponse]) -> TrainingBatch:
    """A batch from its stream of messages (the header comes first; chunks hold consecutive rows)."""
    assembler = BatchAssembler()
    for message in messages:
        assembler.add(message)
    return assembler.finish()
