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
import { DeadlineExceededError, fromConnectError, NotFoundError, typed, UnavailableError } from "./errors.js";
import { FailoverTransport, targetAddresses } from "./failover.js";
import { RETRYABLE_METHODS } from "./gen/lightning/v1/retryable_methods.js";
import { RunnerCalls, unaryRunnerCall, type RunnerCall, type RunnerCallOptions, type RunnerRequests, type RunnerResponses } from "./runner_calls.js";
import { RunnerSession } from "./session.js";
import type { Resource, ResourcesUpdate } from "./gen/lightning/v1/resource_pb.js";
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
  ListRolloutsRequestSchema,
  RolloutSpecSchema,
} from "./gen/lightning/v1/store_service_pb.js";
import { SortOrder } from "./gen/lightning/v1/common_pb.js";
import type { Worker } from "./gen/lightning/v1/worker_pb.js";
import type { DescService, MessageInitShape } from "@bufbuild/protobuf";

export { AttemptStatus, RolloutMode, RolloutStatus, SortOrder, FilterMatch, RunnerSession };
export type { AttemptHeartbeat, DequeueOptions } from "./runner_calls.js";
export type { Attempt, Rollout, Span, Resource, ResourcesUpdate, Worker };

/** TLS for the channel: PEM-encoded roots, and a client certificate for mutual TLS. */
export interface TlsConfig {
  readonly rootCertificates?: string | Buffer;
  readonly privateKey?: string | Buffer;
  readonly certificateChain?: string | Buffer;
}

/**
 * How calls that found no server are retried: UNAVAILABLE only, and only the unary methods the contract
 * marks NO_SIDE_EFFECTS or IDEMPOTENT (RETRYABLE_METHODS, generated from proto/lightning/v1). The Python
 * client's service config retries the same methods from the same marks, with the same back-off; it
 * also retries a marked server stream (GetBatch) until its first message, which this client does not.
 */
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

/**
 * Where the server is and how to reach it (lightning_grpc.client.ClientConfig). Durations are in seconds,
 * as in the Python client, everywhere in this package; a name ending in `Ms` is in milliseconds.
 */
export interface ClientConfig {
  /**
   * host:port of the server (or an http:// / https:// URL); 127.0.0.1:4747 when left out. Several,
   * comma-separated, for a store with standbys: its writer and standbys, whichever serves (FailoverTransport).
   */
  readonly target?: string;
  /** The admin token, or a runner or attempt credential; sent as `authorization: Bearer ...`. */
  readonly token?: string;
  readonly tls?: TlsConfig;
  readonly retry?: RetryConfig | null;
  /** Default deadline of a call, in seconds (long-polls add their wait on top), as the Python client's. */
  readonly timeout?: number;
}

export const DEFAULT_TARGET = "127.0.0.1:4747";

/** A client config from a target string or a partial config, with defaults filled in. */
export function clientConfig(config: string | ClientConfig = DEFAULT_TARGET): Required<Omit<ClientConfig, "tls" | "token">> &
  ClientConfig {
  const given: ClientConfig = typeof config === "string" ? { target: config } : config;
  return Object.freeze({ target: DEFAULT_TARGET, retry: DEFAULT_RETRY, timeout: 30, ...given });
}

/** Seconds as the milliseconds Connect's call options take. */
export function ms(seconds: number): number {
  return Math.round(seconds * 1000);
}

function baseUrl(config: ClientConfig & { target: string }): string {
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

export { RETRYABLE_METHODS };

/** Whether the contract marks a method safe to send again (NO_SIDE_EFFECTS or IDEMPOTENT). */
export function isRetryable(method: { readonly parent: { readonly typeName: string }; readonly name: string }): boolean {
  return RETRYABLE_METHODS.has(`${method.parent.typeName}/${method.name}`);
}

/**
 * Retries a unary call of a retryable method (isRetryable) that the server could not take at all
 * (UNAVAILABLE), with exponential back-off; every other call goes through once.
 */
export function retrying(retry: RetryConfig): Interceptor {
  return (next) => async (req) => {
    if (req.stream || !isRetryable(req.method)) return next(req);
    return withRetries(retry, req.signal, () => next(req));
  };
}

/** `transport` with the retries of `retrying` (for a transport that is not made with interceptors). */
export function retryingTransport(transport: Transport, retry: RetryConfig): Transport {
  return {
    unary: (method, signal, timeoutMs, header, input, contextValues) => {
      const call = () => transport.unary(method, signal, timeoutMs, header, input, contextValues);
      return isRetryable(method) ? withRetries(retry, signal, call) : call();
    },
    stream: (method, signal, timeoutMs, header, input, contextValues) =>
      transport.stream(method, signal, timeoutMs, header, input, contextValues),
  };
}

async function withRetries<T>(retry: RetryConfig, signal: AbortSignal | undefined, call: () => Promise<T>): Promise<T> {
  let backoff = retry.initialBackoffMs;
  for (let attempt = 1; ; attempt++) {
    try {
      return await call();
    } catch (error) {
      const typed = fromConnectError(error);
      if (!(typed instanceof UnavailableError) || attempt >= retry.maxAttempts || signal?.aborted) throw error;
      await sleep(Math.random() * backoff, signal);
      backoff = Math.min(backoff * retry.backoffMultiplier, retry.maxBackoffMs);
    }
  }
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

/**
 * The one place a transport is made: TLS, credential, retries and typed errors. A target of several
 * comma-separated addresses (a store's writer and its standbys) gets one transport per address behind a
 * FailoverTransport, with the retries around it, so that a retried call goes to the next address.
 */
export function createTransport(config: string | ClientConfig = DEFAULT_TARGET): Transport {
  const c = clientConfig(config);
  const addresses = targetAddresses(c.target);
  const interceptors: Interceptor[] = [];
  if (c.retry && addresses.length === 1) interceptors.push(retrying(c.retry));
  if (c.token) interceptors.push(bearer(c.token));
  const transports = addresses.map((target) =>
    createGrpcTransport({
      baseUrl: baseUrl({ ...c, target }),
      interceptors,
      defaultTimeoutMs: ms(c.timeout),
      nodeOptions: c.tls
        ? { ca: c.tls.rootCertificates, key: c.tls.privateKey, cert: c.tls.certificateChain }
        : undefined,
    }),
  );
  if (transports.length === 1) return transports[0] as Transport;
  const failover = new FailoverTransport(transports, addresses);
  return c.retry ? retryingTransport(failover, c.retry) : failover;
}

export interface WatchEvent {
  /** The rollout after the change; undefined in a progress message (only with `includeProgress`). */
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

/** The filters of listRollouts and queryRollouts, named as the Python client's keyword arguments. */
export interface RolloutFilters {
  statusIn?: readonly RolloutStatus[];
  rolloutIds?: readonly string[];
  rolloutIdContains?: string;
  mode?: RolloutMode;
  groupId?: string;
  orderBy?: string;
  descending?: boolean;
  /** Any one filter given must hold instead of all of them. */
  matchAny?: boolean;
}

/** One page of a List call: its items, the token of the next page ("" on the last), the matches in all pages. */
export interface Page<T> {
  readonly items: T[];
  readonly nextPageToken: string;
  readonly totalSize: bigint;
}

/** What AddSpans stored: each span's sequence id, and how many were new or already there. */
export interface AddSpansResult {
  readonly sequenceIds: bigint[];
  readonly storedCount: number;
  readonly duplicateCount: number;
}

function listRolloutsRequest(filters: RolloutFilters): MessageInitShape<typeof ListRolloutsRequestSchema> {
  return {
    statuses: [...(filters.statusIn ?? [])],
    rolloutIds: [...(filters.rolloutIds ?? [])],
    rolloutIdContains: filters.rolloutIdContains ?? "",
    mode: filters.mode ?? RolloutMode.UNSPECIFIED,
    groupId: filters.groupId ?? "",
    orderBy: filters.orderBy ?? "",
    order: filters.descending ? SortOrder.DESCENDING : SortOrder.ASCENDING,
    match: filters.matchAny ? FilterMatch.ANY : FilterMatch.ALL,
  };
}

/** The filters of querySpans, beside the rollout and attempt. */
export interface SpanFilters {
  traceId?: string;
  spanId?: string;
  parentSpanId?: string;
  name?: string;
  nameContains?: string;
}

/** The Store's client (connect-node keeps one HTTP/2 session per transport and closes it when idle). */
export class StoreClient extends RunnerCalls {
  readonly config: ReturnType<typeof clientConfig>;
  readonly transport: Transport;
  /** The generated client: every StoreService RPC with its generated types, typed errors included. */
  readonly raw: Client<typeof StoreService>;
  protected readonly callTimeout: number;

  constructor(config: string | ClientConfig = DEFAULT_TARGET) {
    super();
    this.config = clientConfig(config);
    this.callTimeout = this.config.timeout;
    this.transport = createTransport(this.config);
    this.raw = typedClient(StoreService, this.transport);
  }

  /**
   * The runner's calls (dequeueRollouts, heartbeatAttempt, completeAttempt, completeAndDequeue, ...) as
   * messages of one RunnerSession stream instead of a unary call each; `close()` it when done.
   */
  runnerSession(): RunnerSession {
    return new RunnerSession(this.raw, this.config);
  }

  /** Each runner call as its unary RPC. */
  protected send<K extends RunnerCall>(call: K, request: RunnerRequests[K], options: RunnerCallOptions): Promise<RunnerResponses[K]> {
    return unaryRunnerCall(this.raw, call, request, options);
  }

  /** Wait until the server answers, up to `timeout` seconds (any answer counts, a refusal of the credential too). */
  async waitUntilReachable(timeout: number): Promise<void> {
    const deadline = Date.now() + ms(timeout);
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

  async startAttempt(rolloutId: string, options: { workerId?: string } = {}): Promise<Rollout> {
    return (await this.raw.startAttempt({ rolloutId, workerId: options.workerId ?? "" })).rollout as Rollout;
  }

  async getRollout(rolloutId: string): Promise<Rollout> {
    return (await this.raw.getRollout({ rolloutId })).rollout as Rollout;
  }

  /** The rollout, or undefined when there is none with this id. */
  async getRolloutById(rolloutId: string): Promise<Rollout | undefined> {
    try {
      return await this.getRollout(rolloutId);
    } catch (error) {
      if (error instanceof NotFoundError) return undefined;
      throw error;
    }
  }

  /** End the rollout's stuck attempt (FAILED, with `reason`) and queue it for a new one. */
  async retryRollout(rolloutId: string, reason = ""): Promise<Rollout> {
    return (await this.raw.retryRollout({ rolloutId, reason })).rollout as Rollout;
  }

  async cancelRollout(rolloutId: string, reason = ""): Promise<Rollout> {
    return (await this.raw.cancelRollout({ rolloutId, reason })).rollout as Rollout;
  }

  /** One page of rollouts; the filters given must all hold, or with `matchAny` one of them. */
  async listRollouts(filters: RolloutFilters & { pageSize?: number; pageToken?: string } = {}): Promise<Page<Rollout>> {
    const res = await this.raw.listRollouts({
      ...listRolloutsRequest(filters),
      pageSize: filters.pageSize ?? 0,
      pageToken: filters.pageToken ?? "",
    });
    return { items: res.rollouts, nextPageToken: res.nextPageToken, totalSize: res.totalSize };
  }

  /** Every rollout matching the filters of listRollouts, across all pages. */
  async queryRollouts(filters: RolloutFilters = {}): Promise<Rollout[]> {
    const out: Rollout[] = [];
    let pageToken = "";
    do {
      const page = await this.listRollouts({ ...filters, pageSize: 1000, pageToken });
      out.push(...page.items);
      pageToken = page.nextPageToken;
    } while (pageToken);
    return out;
  }

  // ---------------------------------------------------------------- attempts
  async getLatestAttempt(rolloutId: string): Promise<Attempt | undefined> {
    return (await this.raw.getLatestAttempt({ rolloutId })).attempt;
  }

  // ---------------------------------------------------------------- spans
  /** Store spans in one call (each names its rollout and attempt, or give them here). */
  async addSpans(spans: Span[], options: { rolloutId?: string; attemptId?: string } = {}): Promise<AddSpansResult> {
    const res = await this.raw.addSpans({ rolloutId: options.rolloutId ?? "", attemptId: options.attemptId ?? "", spans });
    return { sequenceIds: res.sequenceIds, storedCount: res.storedCount, duplicateCount: res.duplicateCount };
  }

  /** Store one span; returns its sequence id. */
  async addSpan(span: Span): Promise<bigint> {
    return (await this.addSpans([span])).sequenceIds[0] as bigint;
  }

  /**
   * The spans of a rollout in sequence order, at most `limit` (`attemptId`: undefined for all attempts,
   * "latest", or an id), across all pages.
   */
  async querySpans(rolloutId: string, attemptId?: string, options: SpanFilters & { limit?: number } = {}): Promise<Span[]> {
    const { limit, ...filters } = options;
    const out: Span[] = [];
    let pageToken = "";
    do {
      const res = await this.raw.listSpans({
        selector: { rolloutId, attemptId: attemptId ?? "", ...filters },
        pageSize: limit === undefined ? 10_000 : Math.min(10_000, Math.max(limit, 1)),
        pageToken,
      });
      out.push(...res.spans);
      pageToken = res.nextPageToken;
    } while (pageToken && (limit === undefined || out.length < limit));
    return limit === undefined ? out : out.slice(0, limit);
  }

  /** Batches of a rollout's spans in order; with `follow`, new ones as they are stored, until aborted. */
  async *tailSpans(rolloutId: string, attemptId?: string, options: { follow?: boolean; signal?: AbortSignal } = {}): AsyncIterable<Span[]> {
    const follow = options.follow ?? false;
    const stream = this.raw.tailSpans(
      { selector: { rolloutId, attemptId: attemptId ?? "" }, follow },
      { signal: options.signal, timeoutMs: follow ? 0 : ms(this.config.timeout) },
    );
    for await (const res of stream) yield res.spans;
  }

  // ---------------------------------------------------------------- resources and workers
  /** A resources set: its id, version and named resources. */
  async getResources(resourcesId: string): Promise<ResourcesUpdate> {
    return (await this.raw.getResources({ resourcesId })).resources as ResourcesUpdate;
  }

  async getLatestResources(): Promise<ResourcesUpdate | undefined> {
    return (await this.raw.getLatestResources({})).resources;
  }

  /** Worker heartbeat (creates the worker on its first call); replaces its stats (JSON) when given. */
  async updateWorker(workerId: string, heartbeatStats?: JsonObject): Promise<Worker> {
    return (await this.raw.heartbeatWorker({ workerId, heartbeatStats })).worker as Worker;
  }

  /** The same call as updateWorker, under the RPC's name. */
  async heartbeatWorker(workerId: string, heartbeatStats?: JsonObject): Promise<Worker> {
    return this.updateWorker(workerId, heartbeatStats);
  }

  async statistics(): Promise<GetStatisticsResponse> {
    return this.raw.getStatistics({});
  }

  /**
   * Rollout changes as they are committed. When the server goes away the watch reconnects from the last
   * resume token, so no change is missed; it ends when `signal` aborts.
   */
  async *watchRollouts(
    resumeToken = "",
    options: {
      rolloutIds?: readonly string[];
      statusIn?: readonly RolloutStatus[];
      /** Seconds between progress messages while nothing changes (the server's default when left out). */
      progressInterval?: number;
      /** Yield progress messages too (events without a rollout). */
      includeProgress?: boolean;
      signal?: AbortSignal;
    } = {},
  ): AsyncIterable<WatchEvent> {
    let token = resumeToken;
    const interval = options.progressInterval ? durationFromMs(ms(options.progressInterval)) : undefined;
    for (;;) {
      try {
        const stream = this.raw.watchRollouts(
          { resumeToken: token, rolloutIds: [...(options.rolloutIds ?? [])], statuses: [...(options.statusIn ?? [])], progressInterval: interval },
          { signal: options.signal, timeoutMs: 0 },
        );
        for await (const res of stream) {
          token = res.resumeToken;
          if (res.rollout || options.includeProgress) yield { rollout: res.rollout, resumeToken: res.resumeToken, revision: res.revision };
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

/** The spec as sent: a rollout id chosen here when none is given (as the Python client does), so a retried
 * call returns the same rollout instead of creating a second one. */
function specInit(spec: RolloutSpecInit): MessageInitShape<typeof RolloutSpecSchema> {
  const { input, ...rest } = spec;
  return {
    ...rest,
    rolloutId: rest.rolloutId || `ro-${randomUUID().replaceAll("-", "").slice(0, 16)}`,
    input: input === undefined ? undefined : fromJson(ValueSchema, input),
  };
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
