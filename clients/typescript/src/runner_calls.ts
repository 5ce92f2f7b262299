/**
 * The calls a runner makes for each rollout (claim, heartbeat, report), written once for both ways of making
 * them: `StoreClient` (a unary call each) and `RunnerSession` (a message each on one stream), as the Python
 * client's `lightning_grpc.client.runner_calls`.
 */
import type { JsonObject, MessageInitShape } from "@bufbuild/protobuf";
import type { Client } from "@connectrpc/connect";
import { durationFromMs } from "@bufbuild/protobuf/wkt";
import { randomUUID } from "node:crypto";
import type { AttemptStatus, Attempt, Rollout, RolloutStatus } from "./gen/lightning/v1/rollout_pb.js";
import type { Span } from "./gen/lightning/v1/span_pb.js";
import type {
  CompleteAttemptRequestSchema,
  CompleteAttemptResponse,
  DequeueRolloutsRequestSchema,
  DequeueRolloutsResponse,
  HeartbeatAttemptRequestSchema,
  HeartbeatAttemptResponse,
  StoreService,
} from "./gen/lightning/v1/store_service_pb.js";

/** The requests of the calls a runner makes, by the generated client's method name. */
export interface RunnerRequests {
  dequeueRollouts: MessageInitShape<typeof DequeueRolloutsRequestSchema>;
  heartbeatAttempt: MessageInitShape<typeof HeartbeatAttemptRequestSchema>;
  completeAttempt: MessageInitShape<typeof CompleteAttemptRequestSchema>;
}

/** Their responses. */
export interface RunnerResponses {
  dequeueRollouts: DequeueRolloutsResponse;
  heartbeatAttempt: HeartbeatAttemptResponse;
  completeAttempt: CompleteAttemptResponse;
}

/** One of the calls a runner makes: the field of a RunnerSession message too. */
export type RunnerCall = keyof RunnerRequests;

/** How long one call may take (milliseconds), and the signal that aborts it. */
export interface RunnerCallOptions {
  readonly timeoutMs: number;
  readonly signal?: AbortSignal;
}

export interface DequeueOptions {
  /** The claiming worker. */
  workerId?: string;
  /** Seconds to wait for a rollout while the queue is empty (long poll); 0 or left out: answer at once. */
  wait?: number;
  signal?: AbortSignal;
}

export interface AttemptHeartbeat {
  readonly attempt: Attempt;
  readonly rolloutStatus: RolloutStatus;
  readonly cancelled: boolean;
  /** The Store wants the attempt to stop (cancelled, timed out, or it ended). */
  readonly shouldStop: boolean;
}

/** One runner call as its unary RPC, on the generated client `raw`. */
export function unaryRunnerCall<K extends RunnerCall>(
  raw: Client<typeof StoreService>,
  call: K,
  request: RunnerRequests[K],
  options: RunnerCallOptions,
): Promise<RunnerResponses[K]> {
  const method = raw[call] as (r: RunnerRequests[K], o: RunnerCallOptions) => Promise<RunnerResponses[K]>;
  return method(request, options);
}

/** The calls a runner makes for each rollout; `send` makes one of them (a unary call, or a session's message). */
export abstract class RunnerCalls {
  /** Default deadline of a call, in seconds (a claim adds its wait). */
  protected abstract readonly callTimeout: number;

  protected abstract send<K extends RunnerCall>(
    call: K,
    request: RunnerRequests[K],
    options: RunnerCallOptions,
  ): Promise<RunnerResponses[K]>;

  /**
   * Claim up to `limit` queued rollouts for `workerId`. With `wait` (seconds), the call waits (long poll)
   * until one is queued or the wait ends, and answers at once when one is. Each rollout comes with its
   * new attempt, whose `credential` (with auth on) is the key of that attempt's writes and LLM calls.
   * A request id goes with it, so a claim sent again returns the same rollouts.
   */
  async dequeueRollouts(limit = 1, options: DequeueOptions = {}): Promise<Rollout[]> {
    const wait = options.wait ?? 0;
    const res = await this.send("dequeueRollouts", dequeueRequest(limit, options), {
      timeoutMs: Math.round((this.callTimeout + wait) * 1000),
      signal: options.signal,
    });
    return res.rollouts;
  }

  async dequeueRollout(options: DequeueOptions = {}): Promise<Rollout | undefined> {
    return (await this.dequeueRollouts(1, options))[0];
  }

  /** Tell the Store the attempt is alive; learn whether it should stop. */
  async heartbeatAttempt(rolloutId: string, attemptId: string): Promise<AttemptHeartbeat> {
    const res = await this.send("heartbeatAttempt", { rolloutId, attemptId }, this.plain());
    return {
      attempt: res.attempt as Attempt,
      rolloutStatus: res.rolloutStatus,
      cancelled: res.cancelled,
      shouldStop: res.shouldStop,
    };
  }

  /** Report an attempt's outcome; `spans` are stored in the same commit. Returns [attempt, rollout]. */
  async completeAttempt(
    rolloutId: string,
    attemptId: string,
    status: AttemptStatus,
    message = "",
    metadata?: JsonObject,
    options: { spans?: Span[] } = {},
  ): Promise<[Attempt, Rollout]> {
    const request = { rolloutId, attemptId, status, message, metadata, spans: options.spans ?? [] };
    const res = await this.send("completeAttempt", request, this.plain());
    return [res.attempt as Attempt, res.rollout as Rollout];
  }

  /** Report an attempt's outcome (SUCCEEDED, or FAILED with a message); returns the attempt. */
  async updateAttempt(rolloutId: string, attemptId: string, status: AttemptStatus, message = "", metadata?: JsonObject): Promise<Attempt> {
    const [attempt] = await this.completeAttempt(rolloutId, attemptId, status, message, metadata);
    return attempt;
  }

  /**
   * Report an attempt's outcome and claim up to `limit` next rollouts in the same call (one round trip a
   * rollout). The claim is made only once the report is stored. Returns [attempt, rollout, claimed].
   */
  async completeAndDequeue(
    rolloutId: string,
    attemptId: string,
    status: AttemptStatus,
    options: DequeueOptions & { message?: string; metadata?: JsonObject; spans?: Span[]; limit?: number } = {},
  ): Promise<[Attempt, Rollout, Rollout[]]> {
    const wait = options.wait ?? 0;
    const request = {
      rolloutId,
      attemptId,
      status,
      message: options.message ?? "",
      metadata: options.metadata,
      spans: options.spans ?? [],
      dequeueNext: dequeueRequest(options.limit ?? 1, options),
    };
    const res = await this.send("completeAttempt", request, {
      timeoutMs: Math.round((this.callTimeout + wait) * 1000),
      signal: options.signal,
    });
    return [res.attempt as Attempt, res.rollout as Rollout, res.nextRollouts];
  }

  private plain(): RunnerCallOptions {
    return { timeoutMs: Math.round(this.callTimeout * 1000) };
  }
}

function dequeueRequest(limit: number, options: DequeueOptions): RunnerRequests["dequeueRollouts"] {
  const wait = options.wait ?? 0;
  return {
    workerId: options.workerId ?? "",
    maxRollouts: limit,
    requestId: `dq-${randomUUID()}`,
    waitTimeout: wait > 0 ? durationFromMs(wait * 1000) : undefined,
  };
}
