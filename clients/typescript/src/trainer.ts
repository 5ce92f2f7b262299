/**
 * The Trainer's client (lightning_grpc.client.TrainerClient in Python): submit GRPO groups, take batches
 * of whole groups, report steps and watch training. Same transport as the Store's client (TLS, credential,
 * retries, typed errors), same method names in camelCase, same argument order, durations in seconds.
 *
 * A batch comes back as the stream's messages with its header read out; the rows stay in the contract's
 * `Tensor`s (dtype, shape, little-endian bytes) for the caller to decode.
 */
import { fromJson, type JsonObject, type JsonValue, type MessageInitShape } from "@bufbuild/protobuf";
import { durationFromMs, timestampFromDate, timestampFromMs, ValueSchema } from "@bufbuild/protobuf/wkt";
import type { Client, Transport } from "@connectrpc/connect";
import { randomUUID } from "node:crypto";
import { clientConfig, createTransport, DEFAULT_TARGET, ms, typedClient, type ClientConfig } from "./client.js";
import { RolloutMode, type RolloutConfigSchema } from "./gen/lightning/v1/rollout_pb.js";
import {
  TrainerService,
  type BatchOptionsSchema,
  type BatchHeader,
  type BatchRollout,
  type GetBatchResponse,
  type GetTrainerStatusResponse,
  type GetTripletsResponse,
  type RunInterruption,
  type RunInterruptionSchema,
  type TrainingEvent,
} from "./gen/lightning/v1/trainer_service_pb.js";

export type { BatchHeader, BatchRollout, GetBatchResponse, GetTripletsResponse, RunInterruption, TrainingEvent };
/** What GetTrainerStatus answers: groups pending, ready and consumed per mode, drops, batches, the last step. */
export type TrainerStatus = GetTrainerStatusResponse;
/** What training makes of one rollout: its triplets, rows and everything left out, with reasons. */
export type RolloutTripletReport = GetTripletsResponse;
/** The batch options of the contract (padding, failure policy, aggregation, ...), as a message init. */
export type BatchOptionsInit = MessageInitShape<typeof BatchOptionsSchema>;

/**
 * One interruption of a training run for reportStep: a process of the run that died, why, how the run
 * recovered and how long that took (the contract's RunInterruption; times and durations in seconds).
 */
export interface RunInterruptionInit {
  /** When it was noticed: a Date, or seconds since the Unix epoch (as Python's time.time()). */
  time: Date | number;
  /** Which process died: "server", "engine", "runners", "trainer", ... */
  process: string;
  /** Why, in words: e.g. "exited with signal 9 (SIGKILL)". */
  cause?: string;
  /** How the run recovered and what was redone: e.g. "restarted on the same port after 1.0 s back-off". */
  recovery?: string;
  /** How long the recovery took, in seconds. */
  recoverySeconds?: number;
  /** The training step during which it happened. */
  step?: number | bigint;
}

function interruptionInit(i: RunInterruptionInit): MessageInitShape<typeof RunInterruptionSchema> {
  return {
    time: i.time instanceof Date ? timestampFromDate(i.time) : timestampFromMs(Math.round(i.time * 1000)),
    process: i.process,
    cause: i.cause ?? "",
    recovery: i.recovery ?? "",
    recoverySeconds: i.recoverySeconds ?? 0,
    step: BigInt(i.step ?? 0),
  };
}

/** One sample of submitGroups: a task input, with the group's id (chosen here when left out) and metadata. */
export interface GroupSampleInit {
  input: JsonValue;
  groupId?: string;
  metadata?: JsonObject;
}

export interface SubmittedGroup {
  readonly groupId: string;
  readonly rolloutIds: string[];
}

/** One batch of whole groups, as the GetBatch stream sent it. */
export interface TrainingBatch {
  readonly batchId: string;
  readonly groupIds: string[];
  readonly rollouts: BatchRollout[];
  /** Rollouts and groups left out, by reason. */
  readonly drops: Record<string, bigint>;
  readonly header: BatchHeader;
  /** Every message of the stream, the header's first; each holds whole rows in its `tensors`. */
  readonly messages: GetBatchResponse[];
}

function isSample(value: unknown): value is GroupSampleInit {
  return typeof value === "object" && value !== null && !Array.isArray(value) && "input" in value;
}

function newId(prefix: string): string {
  return `${prefix}-${randomUUID().replaceAll("-", "").slice(0, 16)}`;
}

/** The Trainer's client. */
export class TrainerClient {
  readonly config: ReturnType<typeof clientConfig>;
  readonly transport: Transport;
  /** The generated client: every TrainerService RPC with its generated types, typed errors included. */
  readonly raw: Client<typeof TrainerService>;

  constructor(config: string | ClientConfig = DEFAULT_TARGET) {
    this.config = clientConfig(config);
    this.transport = createTransport(this.config);
    this.raw = typedClient(TrainerService, this.transport);
  }

  /**
   * `groupSize` rollouts per sample (a task input, or `{input, groupId, metadata}`). Group ids are chosen
   * here when a sample has none, so a retried call creates nothing twice.
   */
  async submitGroups(
    samples: readonly (JsonValue | GroupSampleInit)[],
    groupSize: number,
    options: { mode?: RolloutMode; resourcesId?: string; config?: MessageInitShape<typeof RolloutConfigSchema>; step?: number } = {},
  ): Promise<SubmittedGroup[]> {
    const res = await this.raw.submitGroups({
      samples: samples.map((sample) => {
        const s: GroupSampleInit = isSample(sample) ? sample : { input: sample };
        return { groupId: s.groupId || newId("g"), input: fromJson(ValueSchema, s.input), metadata: s.metadata };
      }),
      groupSize,
      mode: options.mode ?? RolloutMode.TRAIN,
      resourcesId: options.resourcesId ?? "",
      config: options.config,
      step: BigInt(options.step ?? 0),
    });
    return res.groups.map((g) => ({ groupId: g.groupId, rolloutIds: g.rolloutIds }));
  }

  /**
   * A batch of whole groups: waits up to `wait` seconds for `minGroups`, takes at most `maxGroups` (0: no
   * limit). A retry with the same `requestId` returns the same groups.
   */
  async getBatch(
    minGroups = 1,
    maxGroups = 0,
    options: { wait?: number; mode?: RolloutMode; options?: BatchOptionsInit; requestId?: string; signal?: AbortSignal } = {},
  ): Promise<TrainingBatch> {
    const wait = options.wait ?? 0;
    const messages: GetBatchResponse[] = [];
    const stream = this.raw.getBatch(
      {
        requestId: options.requestId || newId("b"),
        mode: options.mode ?? RolloutMode.TRAIN,
        minGroups,
        maxGroups,
        wait: durationFromMs(ms(wait)),
        options: options.options,
      },
      { timeoutMs: ms(this.config.timeout + wait), signal: options.signal },
    );
    for await (const message of stream) messages.push(message);
    const header = messages[0]?.header;
    if (!header) throw new Error("a batch stream starts with its header");
    if (messages.length !== header.chunkCount) {
      throw new Error(`the batch stream ended after ${messages.length} of ${header.chunkCount} chunks`);
    }
    return {
      batchId: header.batchId,
      groupIds: header.groupIds,
      rollouts: header.rollouts,
      drops: Object.fromEntries(header.drops.map((d) => [d.reason, d.count])),
      header,
      messages,
    };
  }

  /**
   * Report a finished step and the policy version it produced, with the run's interruptions recovered since
   * its previous report. A resend with the same content (interruptions included) returns the stored event.
   */
  async reportStep(
    step: number,
    policyVersion: number,
    metrics: Record<string, number> = {},
    options: { runId?: string; interruptions?: RunInterruptionInit[] } = {},
  ): Promise<TrainingEvent> {
    const res = await this.raw.reportStep({
      runId: options.runId ?? "",
      step: BigInt(step),
      policyVersion: BigInt(policyVersion),
      metrics,
      interruptions: (options.interruptions ?? []).map(interruptionInit),
    });
    return res.event as TrainingEvent;
  }

  /** Reported steps after `afterSequence`; with `follow`, new ones as they are reported, until aborted. */
  async *watchTraining(runId = "", options: { afterSequence?: number | bigint; follow?: boolean; signal?: AbortSignal } = {}): AsyncIterable<TrainingEvent> {
    const follow = options.follow ?? false;
    const stream = this.raw.watchTraining(
      { runId, afterSequence: BigInt(options.afterSequence ?? 0), follow },
      { signal: options.signal, timeoutMs: follow ? 0 : ms(this.config.timeout) },
    );
    for await (const message of stream) if (message.event) yield message.event;
  }

  async status(): Promise<TrainerStatus> {
    return this.raw.getTrainerStatus({});
  }

  /** The triplets of a rollout's latest attempt, its rows, and the reasons for anything not trained. */
  async triplets(rolloutId: string, options?: BatchOptionsInit): Promise<RolloutTripletReport> {
    return this.raw.getTriplets({ rolloutId, options });
  }
}
