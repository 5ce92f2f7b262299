/**
 * The Store's client: the generated Protobuf-ES service client over gRPC (HTTP/2), with the parts that
 * make it pleasant written by hand and named as in the Python client (`lightning_grpc.client.StoreClient`):
 * a long-poll dequeue, heartbeats, a watch that resumes from its token, and typed errors from ErrorInfo.
 *
 * Every RPC of the contract is on `client.raw` with its generated request and response types; the
 * methods below cover what a runner, an agent or an algorithm calls most.
 */
import { fromJson, toJson, type JsonObject, type JsonValue } from "@bufbuild/protobuf";
import { durationFromMs, ValueSchema } from "@bufbuild/protobuf/wkt";
import { createClient, type Client, type Interceptor, type Transport } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { randomUUID } from "node:crypto";
import { DeadlineExceededError, fromConnectError, typed, UnavailableError } from "./errors.js";
import type { Resource } from "./gen/lightning/v1/resource_pb.js";
import {
  AttemptStatus,
  RolloutMode,
  RolloutStatus,
  type Attempt,
  type Rollout,
  RolloutConfigSchema,
  type RolloutConfig,
} from "./gen/lightning/v1/rollout_pb.js";
import type { Span } from "./gen/lightning/v1/span_pb.js";
import {
  FilterMatch,
  StoreService,
  type GetStatisticsResponse,
  type ListRolloutsRequest,
  RolloutSpecSchema,
} from "./gen/lightning/v1/store_service_pb.js";
import { SortOrder } from "./gen/lightning/v1/common_pb.js";
import type { Worker } from "./gen/lightning/v1/worker_pb.js";
import type { DescService, MessageInitShape } from "@bufbuild/protobuf";

export { AttemptStatus, RolloutMode, RolloutStatus, SortOrder, FilterMatch };
export type { Attempt, Rollout, Span, Resource, Worker };

/** TLS for the channel: PEM-encoded roots, and a client certificate for mutual TLS. */
export interface TlsConfig {
  readonly rootCertificates?: string | Buffer;
  readonly privateKey?: string | Buffer;
  readonly certificateChain?: string | Buffer;
}

/** How calls that found no server are retried (UNAVAILABLE only, as the Python client's service config). */
export interface RetryConfig {
  readonly maxAttempts: number;
  readonly initialBackoffMs: number;
  readonly maxBackoffMs: number;
  readonly backoffMultiplier: number;
}

export const DEFAULT_RETRY: RetryConfig = Object.freeze({
  maxAttempts: 5,
  initialBackoffMs: 100,
  maxBackoffMs: 5000,
  backoffMultiplier: 2,
});

/** Where the server is and how to reach it. */
export interface ClientConfig {
  /** host:port of the server (or an http:// / https:// URL). */
  readonly target: string;
  /** The admin token, or a runner or attempt credential; sent as `authorization: Bearer ...`. */
  readonly token?: string;
  readonly tls?: TlsConfig;
  readonly retry?: RetryConfig | null;
  /** Deadline of each unary call, in milliseconds (a long-poll adds its wait). */
  readonly timeoutMs?: number;
}

/** A client config from a target string or a partial config, with defaults filled in. */
export function clientConfig(config: string | ClientConfig): Required<Omit<ClientConfig, "tls" | "token">> &
  ClientConfig {
  const given: ClientConfig = typeof config === "string" ? { target: config } : config;
  return Object.freeze({ retry: DEFAULT_RETRY, timeoutMs: 30_000, ...given });
}

function baseUrl(config: ClientConfig): string {
  if (/^https?:\/\//.test(config.target)) return config.target;
  return `${config.tls ? "https" : "http"}://${config.target}`;
}

/** Sends the credential with every call. */
function bearer(token: string): Interceptor {
  return (next) => async (req) => {
    req.header.set("authorization", `Bearer ${token}`);
    return next(req);
  };
}

/** Retries a unary call the server could not take at all (UNAVAILABLE), with exponential back-off. */
function retrying(retry: RetryConfig): Interceptor {
  return (next) => async (req) => {
    if (req.stream) return next(req);
    let backoff = retry.initialBackoffMs;
    for (let attempt = 1; ; attempt++) {
      try {
        return await next(req);
      } catch (error) {
        const typed = fromConnectError(error);
        if (!(typed instanceof UnavailableError) || attempt >= retry.maxAttempts || req.signal.aborted) throw error;
        await sleep(Math.random() * backoff, req.signal);
        backoff = Math.min(backoff * retry.backoffMultiplier, retry.maxBackoffMs);
      }
    }
  };
}

/**
 * The generated client of `service`, with every error of every call (unary, or while a stream is read)
 * thrown as a typed LightningError. (Interceptors cannot do this: the generated client turns whatever
 * they throw back into a ConnectError.)
 */
export function typedClient<T extends DescService>(service: T, transport: Transport): Client<T> {
  const client = createClient(service, transport) as unknown as Record<string, (...args: unknown[]) => unknown>;
  const out: Record<string, unknown> = {};
  for (const method of service.methods) {
    const call = client[method.localName] as (...args: unknown[]) => unknown;
    if (method.methodKind === "unary" || method.methodKind === "client_streaming") {
      out[method.localName] = (...args: unknown[]) => typed(() => call(...args) as Promise<unknown>);
    } else {
      out[method.localName] = (...args: unknown[]) => typedStream(call(...args) as AsyncIterable<unknown>);
    }
  }
  return out as Client<T>;
}

async function* typedStream<M>(stream: AsyncIterable<M>): AsyncIterable<M> {
  try {
    yield* stream;
  } catch (error) {
    throw fromConnectError(error);
  }
}

/** The one place a transport is made: TLS, credential, retries and typed errors. */
export function createTransport(config: string | ClientConfig): Transport {
  const c = clientConfig(config);
  const interceptors: Interceptor[] = [];
  if (c.retry) interceptors.push(retrying(c.retry));
  if (c.token) interceptors.push(bearer(c.token));
  return createGrpcTransport({
    baseUrl: baseUrl(c),
    interceptors,
    defaultTimeoutMs: c.timeoutMs,
    nodeOptions: c.tls
      ? { ca: c.tls.rootCertificates, key: c.tls.privateKey, cert: c.tls.certificateChain }
      : undefined,
  });
}

export interface AttemptHeartbeat {
  readonly attempt: Attempt;
  readonly rolloutStatus: RolloutStatus;
  readonly cancelled: boolean;
  /** The Store wants the attempt to stop (cancelled, timed out, or it ended). */
  readonly shouldStop: boolean;
}

export interface WatchEvent {
  readonly rollout: Rollout | undefined;
  readonly resumeToken: string;
  readonly revision: bigint;
}

/** A rollout to create: its input as plain JSON, the rest as in lightning.v1.RolloutSpec. */
export interface RolloutSpecInit {
  rolloutId?: string;
  input?: JsonValue;
  mode?: RolloutMode;
  resourcesId?: string;
  groupId?: string;
  config?: MessageInitShape<typeof RolloutConfigSchema>;
  metadata?: JsonObject;
}

/** Filters of ListRollouts (every page is fetched). */
export type RolloutFilters = Partial<Omit<ListRolloutsRequest, "$typeName" | "$unknown" | "pageToken">>;

/** The Store's client (connect-node keeps one HTTP/2 session per transport and closes it when idle). */
export class StoreClient {
  readonly config: ReturnType<typeof clientConfig>;
  readonly transport: Transport;
  /** The generated client: every StoreService RPC with its generated types, typed errors included. */
  readonly raw: Client<typeof StoreService>;

  constructor(config: string | ClientConfig) {
    this.config = clientConfig(config);
    this.transport = createTransport(this.config);
    this.raw = typedClient(StoreService, this.transport);
  }

  /** Wait until the server answers, up to `timeoutMs` (any answer counts, a refusal of the credential too). */
  async waitUntilReachable(timeoutMs: number): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      try {
        await this.raw.getStatistics({}, { timeoutMs: Math.max(500, Math.min(5000, deadline - Date.now())) });
        return;
      } catch (error) {
        if (!(error instanceof UnavailableError || error instanceof DeadlineExceededError)) return;
        if (Date.now() >= deadline) throw error;
        await sleep(200);
      }
    }
  }

  // ---------------------------------------------------------------- rollouts
  async enqueueRollouts(specs: readonly RolloutSpecInit[]): Promise<Rollout[]> {
    const res = await this.raw.enqueueRollouts({ rollouts: specs.map(specInit) });
    return res.rollouts;
  }

  async enqueueRollout(input: JsonValue, spec: Omit<RolloutSpecInit, "input"> = {}): Promise<Rollout> {
    const [rollout] = await this.enqueueRollouts([{ ...spec, input }]);
    return rollout as Rollout;
  }

  /** Create a rollout already claimed by `workerId`, with its first attempt (and that attempt's credential). */
  async startRollout(input: JsonValue, options: { workerId?: string } & Omit<RolloutSpecInit, "input"> = {}): Promise<Rollout> {
    const { workerId = "", ...spec } = options;
    const res = await this.raw.startRollout({ rollout: specInit({ ...spec, input }), workerId });
    return res.rollout as Rollout;
  }

  /**
   * Claim up to `limit` queued rollouts for `workerId`. With `waitSeconds`, the call waits (long poll)
   * until one is queued or the wait ends, and answers at once when one is. Each rollout comes with its
   * new attempt, whose `credential` (with auth on) is the key of that attempt's writes and LLM calls.
   */
  async dequeueRollouts(limit = 1, options: { workerId?: string; waitSeconds?: number; signal?: AbortSignal } = {}): Promise<Rollout[]> {
    const wait = options.waitSeconds ?? 0;
    const res = await this.raw.dequeueRollouts(
      {
        workerId: options.workerId ?? "",
        maxRollouts: limit,
        requestId: `dq-${randomUUID()}`,
        waitTimeout: wait > 0 ? durationFromMs(wait * 1000) : undefined,
      },
      { timeoutMs: this.config.timeoutMs + wait * 1000, signal: options.signal },
    );
    return res.rollouts;
  }

  async dequeueRollout(options: { workerId?: string; waitSeconds?: number } = {}): Promise<Rollout | undefined> {
    return (await this.dequeueRollouts(1, options))[0];
  }

  async startAttempt(rolloutId: string, options: { workerId?: string } = {}): Promise<Rollout> {
    return (await this.raw.startAttempt({ rolloutId, workerId: options.workerId ?? "" })).rollout as Rollout;
  }

  async getRollout(rolloutId: string): Promise<Rollout> {
    return (await this.raw.getRollout({ rolloutId })).rollout as Rollout;
  }

  async cancelRollout(rolloutId: string, reason = ""): Promise<Rollout> {
    return (await this.raw.cancelRollout({ rolloutId, reason })).rollout as Rollout;
  }

  /** Every rollout matching the filters, all pages. */
  async queryRollouts(filters: RolloutFilters = {}): Promise<Rollout[]> {
    const out: Rollout[] = [];
    let pageToken = "";
    do {
      const res = await this.raw.listRollouts({ ...filters, pageToken });
      out.push(...res.rollouts);
      pageToken = res.nextPageToken;
    } while (pageToken);
    return out;
  }

  // ---------------------------------------------------------------- attempts
  async heartbeatAttempt(rolloutId: string, attemptId: string): Promise<AttemptHeartbeat> {
    const res = await this.raw.heartbeatAttempt({ rolloutId, attemptId });
    return {
      attempt: res.attempt as Attempt,
      rolloutStatus: res.rolloutStatus,
      cancelled: res.cancelled,
      shouldStop: res.shouldStop,
    };
  }

  /** Report an attempt's outcome; `spans` are stored in the same commit. */
  async completeAttempt(
    rolloutId: string,
    attemptId: string,
    status: AttemptStatus,
    options: { message?: string; metadata?: JsonObject; spans?: Span[] } = {},
  ): Promise<{ attempt: Attempt; rollout: Rollout }> {
    const res = await this.raw.completeAttempt({
      rolloutId,
      attemptId,
      status,
      message: options.message ?? "",
      metadata: options.metadata,
      spans: options.spans ?? [],
    });
    return { attempt: res.attempt as Attempt, rollout: res.rollout as Rollout };
  }

  // ---------------------------------------------------------------- spans
  /** Store spans of one attempt in one call; returns their sequence ids. */
  async addSpans(rolloutId: string, attemptId: string, spans: Span[]): Promise<bigint[]> {
    return (await this.raw.addSpans({ rolloutId, attemptId, spans })).sequenceIds;
  }

  /** Spans of a rollout (or one attempt of it), all pages, in sequence order. */
  async querySpans(rolloutId: string, attemptId = ""): Promise<Span[]> {
    const out: Span[] = [];
    let pageToken = "";
    do {
      const res = await this.raw.listSpans({ selector: { rolloutId, attemptId }, pageToken });
      out.push(...res.spans);
      pageToken = res.nextPageToken;
    } while (pageToken);
    return out;
  }

  /** Spans as they are stored: those already there, then (with `follow`) new ones until aborted. */
  async *tailSpans(rolloutId: string, options: { attemptId?: string; follow?: boolean; signal?: AbortSignal } = {}): AsyncIterable<Span> {
    const stream = this.raw.tailSpans(
      { selector: { rolloutId, attemptId: options.attemptId ?? "" }, follow: options.follow ?? false },
      { signal: options.signal, timeoutMs: 0 },
    );
    for await (const res of stream) yield* res.spans;
  }

  // ---------------------------------------------------------------- resources and workers
  async getResources(resourcesId: string): Promise<Record<string, Resource>> {
    return (await this.raw.getResources({ resourcesId })).resources?.resources ?? {};
  }

  /** The worker's heartbeat, with its stats (JSON). */
  async updateWorker(workerId: string, stats: JsonObject = {}): Promise<Worker> {
    return (await this.raw.heartbeatWorker({ workerId, heartbeatStats: stats })).worker as Worker;
  }

  async statistics(): Promise<GetStatisticsResponse> {
    return this.raw.getStatistics({});
  }

  /**
   * Rollout changes as they are committed. When the server goes away the watch reconnects from the last
   * resume token, so no change is missed; it ends when `signal` aborts.
   */
  async *watchRollouts(options: { resumeToken?: string; rolloutIds?: string[]; statuses?: RolloutStatus[]; signal?: AbortSignal } = {}): AsyncIterable<WatchEvent> {
    let token = options.resumeToken ?? "";
    for (;;) {
      try {
        const stream = this.raw.watchRollouts(
          { resumeToken: token, rolloutIds: options.rolloutIds ?? [], statuses: options.statuses ?? [] },
          { signal: options.signal, timeoutMs: 0 },
        );
        for await (const res of stream) {
          token = res.resumeToken;
          if (res.rollout) yield { rollout: res.rollout, resumeToken: res.resumeToken, revision: res.revision };
        }
        return;
      } catch (error) {
        if (options.signal?.aborted) return;
        if (error instanceof UnavailableError && token) {
          await sleep(200, options.signal);
          continue;
        }
        throw error;
      }
    }
  }
}

/** A rollout's input as plain JSON. */
export function inputOf(rollout: Rollout): JsonValue {
  return rollout.input ? toJson(ValueSchema, rollout.input) : null;
}

function specInit(spec: RolloutSpecInit): MessageInitShape<typeof RolloutSpecSchema> {
  const { input, ...rest } = spec;
  return { ...rest, input: input === undefined ? undefined : fromJson(ValueSchema, input) };
}

export type { RolloutConfig };

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const timer = setTimeout(done, ms);
    function done() {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done, { once: true });
  });
}
