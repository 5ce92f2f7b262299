/**
 * The Runner, in TypeScript: long-polls the Store for rollouts and plays up to `concurrency` of them at
 * once with an agent function, as the Python runner (`lightning_grpc.runner.Runner`) does.
 *
 * For each claimed rollout it routes the LLM resource to the attempt (the proxy's per-attempt URL, with
 * the attempt's credential as its API key, so the agent's OpenAI client needs no change), heartbeats the
 * attempt (and stops the agent through `ctx.signal` when the Store says so), records the attempt's root
 * span `lightning.rollout` and the agent's reward as a `lightning.reward` span over the span stream, and
 * reports the outcome: SUCCEEDED, or FAILED with the error kept in the attempt's metadata.
 */
import type { JsonObject, JsonValue } from "@bufbuild/protobuf";
import { toJson } from "@bufbuild/protobuf";
import { ValueSchema } from "@bufbuild/protobuf/wkt";
import { hostname } from "node:os";
import { randomUUID } from "node:crypto";
import { AttemptStatus, DEFAULT_TARGET, RolloutMode, StoreClient, inputOf, ms, sleep, type ClientConfig, type Rollout } from "./client.js";
import { FailedPreconditionError, LightningError, NotFoundError } from "./errors.js";
import type { RunnerCalls } from "./runner_calls.js";
import type { Resource } from "./gen/lightning/v1/resource_pb.js";
import { log } from "./log.js";
import { SpanStream, makeSpan, newSpanId, nowNanos, rolloutTraceId } from "./spans.js";
import { rewardAttributes, semconv, type AttributeValue } from "./semconv.js";

/** An OpenAI-compatible endpoint, already routed to the attempt when it is behind the proxy. */
export interface LLM {
  readonly endpoint: string;
  readonly model: string;
  readonly apiKey: string;
  readonly samplingParameters: JsonObject;
}

export type RoutedResource =
  | { readonly kind: "llm"; readonly llm: LLM }
  | { readonly kind: "prompt_template"; readonly template: string; readonly engine: string }
  | { readonly kind: "json"; readonly value: JsonValue };

export type Reward = number | Record<string, number>;

/** What an agent knows of the attempt it plays, and what it may record on it. */
export class AttemptContext {
  readonly traceId: string;
  readonly rootSpanId = newSpanId();
  readonly spans: SpanStreamLike;
  private readonly stopper = new AbortController();

  constructor(readonly rollout: Rollout, spans: SpanStreamLike) {
    this.traceId = rolloutTraceId(rollout.rolloutId);
    this.spans = spans;
  }

  get rolloutId(): string {
    return this.rollout.rolloutId;
  }
  get attemptId(): string {
    return this.rollout.latestAttempt?.attemptId ?? "";
  }
  /** The attempt's credential (with auth on): the key of its writes and its LLM calls. */
  get credential(): string {
    return this.rollout.latestAttempt?.credential ?? "";
  }
  /** Aborted when the Store wants the attempt to stop (cancelled, timed out); pass it to long calls. */
  get signal(): AbortSignal {
    return this.stopper.signal;
  }
  get stopped(): boolean {
    return this.stopper.signal.aborted;
  }
  stop(why: string): void {
    this.stopper.abort(new Error(why));
  }

  /** Record a finished span under the attempt's root span (start and end in Unix nanoseconds). */
  emitSpan(name: string, attributes: Record<string, AttributeValue> = {}, timing: { start?: bigint; end?: bigint } = {}): void {
    this.spans.submit(
      makeSpan({
        name,
        rolloutId: this.rolloutId,
        attemptId: this.attemptId,
        traceId: this.traceId,
        parentSpanId: this.rootSpanId,
        attributes,
        ...timing,
      }),
    );
  }

  /** Record a reward: a number, or named dimensions with `primary` naming the one to train on. */
  emitReward(reward: Reward, primary?: string): void {
    this.emitSpan(semconv.SPAN_REWARD, rewardAttributes(reward, primary));
  }
}

interface SpanStreamLike {
  submit: SpanStream["submit"];
}

export type Agent = (task: JsonValue, resources: AgentResources, ctx: AttemptContext) => Promise<Reward | void> | Reward | void;

/** The rollout's resources as the attempt sees them; `llm` is the LLM endpoint (with several, `main_llm`). */
export interface AgentResources {
  readonly llm: LLM | undefined;
  readonly all: Readonly<Record<string, RoutedResource>>;
}

/** The Python runner's keyword arguments, in camelCase; every duration in seconds. */
export interface RunnerOptions {
  concurrency?: number;
  workerId?: string;
  /** Seconds between an attempt's heartbeats (default 5). */
  heartbeatInterval?: number;
  /** Seconds between the worker's heartbeats (default 10). */
  workerHeartbeatInterval?: number;
  /** Seconds a dequeue waits for work (default 2). */
  pollWait?: number;
  maxRollouts?: number;
  /** Seconds running rollouts get to finish once stopped (default 30). */
  drainTimeout?: number;
  /** The Store's credential, when `store` is a target string. */
  token?: string;
  /** Seconds to wait for the Store at start (default 30). */
  connectTimeout?: number;
}

/** The per-attempt URL of a proxy endpoint: `{endpoint}/rollout/{r}/attempt/{a}`, keeping a trailing `/v1` last. */
export function attemptBaseUrl(endpoint: string, rolloutId: string, attemptId: string): string {
  let base = endpoint.replace(/\/+$/, "");
  let suffix = "";
  if (base.endsWith("/v1")) {
    base = base.slice(0, -3);
    suffix = "/v1";
  }
  return `${base}/rollout/${encodeURIComponent(rolloutId)}/attempt/${encodeURIComponent(attemptId)}${suffix}`;
}

/** Resources as one attempt sees them: proxy endpoints become the attempt's own, keyed by its credential. */
export function routedResources(resources: Record<string, Resource>, rollout: Rollout): AgentResources {
  const attempt = rollout.latestAttempt;
  const all: Record<string, RoutedResource> = {};
  for (const [name, resource] of Object.entries(resources)) {
    const kind = resource.kind;
    if (kind.case === "llm" || kind.case === "proxyLlm") {
      const routed = kind.case === "proxyLlm" && attempt !== undefined;
      all[name] = {
        kind: "llm",
        llm: {
          endpoint: routed ? attemptBaseUrl(kind.value.endpoint, rollout.rolloutId, attempt.attemptId) : kind.value.endpoint,
          model: kind.value.model,
          apiKey: (routed && attempt.credential) || kind.value.apiKey,
          samplingParameters: kind.value.samplingParameters ?? {},
        },
      };
    } else if (kind.case === "promptTemplate") {
      all[name] = { kind: "prompt_template", template: kind.value.template, engine: kind.value.engine };
    } else if (kind.case === "json") {
      all[name] = { kind: "json", value: toJson(ValueSchema, kind.value) };
    }
  }
  const llms = Object.entries(all).filter(([, r]) => r.kind === "llm");
  const chosen = llms.length === 1 ? llms[0] : llms.find(([name]) => name === "main_llm");
  return { llm: chosen && chosen[1].kind === "llm" ? chosen[1].llm : undefined, all };
}

export function defaultWorkerId(): string {
  return `${hostname()}-${process.pid}-${randomUUID().slice(0, 6)}`;
}

/** Runs an agent on rollouts from the Store. */
export class Runner {
  readonly client: StoreClient;
  /** Where claims, heartbeats and reports go: a RunnerSession stream while run() runs, the client otherwise (step()). */
  private calls: RunnerCalls;
  readonly spans: SpanStream;
  readonly workerId: string;
  completed = 0;
  succeeded = 0;
  failed = 0;
  stopped = 0;
  private readonly active = new Map<string, Promise<void>>();
  private readonly resources = new Map<string, Promise<Record<string, Resource>>>();
  private readonly stopping = new AbortController();
  private readonly o: Required<Omit<RunnerOptions, "workerId" | "maxRollouts" | "token">> & Pick<RunnerOptions, "maxRollouts">;

  /** As the Python runner: `Runner(agent, store, {concurrency, workerId, ...})`. */
  constructor(readonly agent: Agent, store: string | ClientConfig = DEFAULT_TARGET, options: RunnerOptions = {}) {
    this.client = new StoreClient(typeof store === "string" ? { target: store, token: options.token } : store);
    this.calls = this.client;
    this.spans = new SpanStream(this.client, {
      onGivenUp: (spans, error) => log.warning("spans_given_up", { count: spans.length, reason: error.reason, error: error.message }),
    });
    this.workerId = options.workerId || defaultWorkerId();
    this.o = {
      concurrency: options.concurrency ?? 1,
      heartbeatInterval: options.heartbeatInterval ?? 5,
      workerHeartbeatInterval: options.workerHeartbeatInterval ?? 10,
      pollWait: options.pollWait ?? 2,
      maxRollouts: options.maxRollouts,
      drainTimeout: options.drainTimeout ?? 30,
      connectTimeout: options.connectTimeout ?? 30,
    };
    if (this.o.concurrency < 1) throw new RangeError("concurrency must be at least 1");
  }

  /** Stop taking new rollouts; running ones finish (up to the drain timeout). */
  stop(): void {
    this.stopping.abort();
  }

  /** Take and run rollouts until stopped (or `maxRollouts`); returns how many this runner finished. */
  async run(): Promise<number> {
    await this.client.waitUntilReachable(this.o.connectTimeout);
    await this.beatWorker();
    const beats = setInterval(() => void this.beatWorker(), ms(this.o.workerHeartbeatInterval));
    log.info("runner_started", { worker_id: this.workerId, concurrency: this.o.concurrency, store: this.client.config.target, language: "typescript" });
    const session = this.client.runnerSession();
    this.calls = session;
    try {
      while (!this.stopping.signal.aborted && !this.reachedMax()) {
        let free = this.o.concurrency - this.active.size;
        if (this.o.maxRollouts !== undefined) free = Math.min(free, this.o.maxRollouts - this.completed - this.active.size);
        if (free <= 0) {
          await Promise.race([...this.active.values(), aborted(this.stopping.signal)]);
          continue;
        }
        let claimed: Rollout[];
        try {
          // Not aborted by stop(): a claim sent is answered (within pollWait) and what it claimed is run, as
          // the Python runner does, so that no rollout is claimed by a runner that has gone.
          claimed = await this.calls.dequeueRollouts(free, { workerId: this.workerId, wait: this.o.pollWait });
        } catch (error) {
          if (this.stopping.signal.aborted) break;
          log.warning("dequeue_failed", { worker_id: this.workerId, error: String((error as Error).message) });
          await sleep(Math.min(ms(this.o.pollWait), 1000), this.stopping.signal);
          continue;
        }
        for (const rollout of claimed) this.launch(rollout);
      }
      await this.drain();
    } finally {
      clearInterval(beats);
      await this.spans.close();
      await session.close();
      this.calls = this.client;
      log.info("runner_stopped", {
        worker_id: this.workerId,
        completed: this.completed,
        succeeded: this.succeeded,
        failed: this.failed,
        stopped: this.stopped,
      });
    }
    return this.completed;
  }

  /** Run one rollout right here (created with StartRollout, claimed by this worker). */
  async step(input: JsonValue, spec: { mode?: RolloutMode; resourcesId?: string } = {}): Promise<Rollout> {
    const rollout = await this.client.startRollout(input, { workerId: this.workerId, ...spec });
    await this.runOne(rollout);
    return this.client.getRollout(rollout.rolloutId);
  }

  private reachedMax(): boolean {
    return this.o.maxRollouts !== undefined && this.completed >= this.o.maxRollouts;
  }

  private launch(rollout: Rollout): void {
    const task = this.runOne(rollout).finally(() => this.active.delete(rollout.rolloutId));
    this.active.set(rollout.rolloutId, task);
  }

  private async resourcesOf(rollout: Rollout): Promise<Record<string, Resource>> {
    if (!rollout.resourcesId) return {};
    let cached = this.resources.get(rollout.resourcesId);
    if (!cached) {
      cached = this.client.getResources(rollout.resourcesId).then((update) => update.resources);
      this.resources.set(rollout.resourcesId, cached);
      cached.catch(() => this.resources.delete(rollout.resourcesId));
    }
    return cached;
  }

  private async runOne(rollout: Rollout): Promise<void> {
    const attempt = rollout.latestAttempt;
    if (!attempt) throw new Error(`rollout ${rollout.rolloutId} was claimed without an attempt`);
    const ctx = new AttemptContext(rollout, this.spans);
    const started = nowNanos();
    let error: unknown;
    let reward: Reward | void = undefined;
    const heartbeat = setInterval(() => void this.heartbeat(ctx), ms(this.o.heartbeatInterval));
    try {
      const resources = routedResources(await this.resourcesOf(rollout), rollout);
      reward = await this.agent(inputOf(rollout), resources, ctx);
      if (reward !== undefined && reward !== null && !ctx.stopped) {
        if (typeof reward === "boolean") throw new TypeError("an agent returned a boolean; return a number reward, a record of rewards, or nothing");
        ctx.emitReward(reward, typeof reward === "object" ? Object.keys(reward)[0] : undefined);
      }
    } catch (caught) {
      error = caught;
    } finally {
      clearInterval(heartbeat);
    }
    this.spans.submit(
      makeSpan({
        name: semconv.SPAN_ROLLOUT,
        rolloutId: rollout.rolloutId,
        attemptId: attempt.attemptId,
        traceId: ctx.traceId,
        spanId: ctx.rootSpanId,
        start: started,
        attributes: {
          [semconv.ROLLOUT_ID]: rollout.rolloutId,
          [semconv.ATTEMPT_ID]: attempt.attemptId,
          [semconv.ATTEMPT_SEQUENCE_NUMBER]: BigInt(attempt.sequenceNumber),
        },
        error: error === undefined ? undefined : describe(error),
      }),
    );
    if (!(await this.spans.flush(rollout.rolloutId, attempt.attemptId, 30))) {
      log.warning("spans_not_flushed", { rollout_id: rollout.rolloutId, attempt_id: attempt.attemptId });
    }
    await this.report(ctx, error);
    this.completed++;
    if (ctx.stopped) this.stopped++;
    else if (error === undefined) this.succeeded++;
    else this.failed++;
  }

  private async heartbeat(ctx: AttemptContext): Promise<void> {
    try {
      const beat = await this.calls.heartbeatAttempt(ctx.rolloutId, ctx.attemptId);
      if (beat.shouldStop && !ctx.stopped) {
        const why = beat.cancelled ? "cancelled" : `attempt ${AttemptStatus[beat.attempt.status]}`;
        log.info("attempt_stopping", { rollout_id: ctx.rolloutId, attempt_id: ctx.attemptId, why });
        ctx.stop(why);
      }
    } catch (error) {
      log.warning("heartbeat_failed", { attempt_id: ctx.attemptId, error: String((error as Error).message) });
    }
  }

  private async report(ctx: AttemptContext, error: unknown): Promise<void> {
    try {
      if (ctx.stopped) return;
      if (error === undefined) {
        await this.calls.completeAttempt(ctx.rolloutId, ctx.attemptId, AttemptStatus.SUCCEEDED);
        return;
      }
      const message = describe(error).slice(0, 4000);
      log.warning("agent_failed", { rollout_id: ctx.rolloutId, attempt_id: ctx.attemptId, error: message });
      await this.calls.completeAttempt(ctx.rolloutId, ctx.attemptId, AttemptStatus.FAILED, message, { error: errorRecord(error) });
    } catch (refused) {
      if (refused instanceof FailedPreconditionError || refused instanceof NotFoundError) {
        log.info("report_refused", { rollout_id: ctx.rolloutId, attempt_id: ctx.attemptId, reason: refused.reason });
      } else if (refused instanceof LightningError) {
        log.warning("report_failed", { rollout_id: ctx.rolloutId, attempt_id: ctx.attemptId, error: refused.message });
      } else {
        throw refused;
      }
    }
  }

  private async drain(): Promise<void> {
    if (this.active.size === 0) return;
    log.info("runner_draining", { worker_id: this.workerId, active: this.active.size });
    const all = Promise.allSettled([...this.active.values()]);
    await Promise.race([all, sleep(ms(this.o.drainTimeout))]);
  }

  private async beatWorker(): Promise<void> {
    try {
      await this.client.updateWorker(this.workerId, {
        active_rollouts: this.active.size,
        completed_rollouts: this.completed,
        runtime: `node ${process.version}`,
        rss_bytes: process.memoryUsage().rss,
      });
    } catch (error) {
      log.warning("worker_heartbeat_failed", { worker_id: this.workerId, error: String((error as Error).message) });
    }
  }
}

function aborted(signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal.aborted) resolve();
    signal.addEventListener("abort", () => resolve(), { once: true });
  });
}

function describe(error: unknown): string {
  return error instanceof Error ? `${error.name}: ${error.message}` : String(error);
}

/** What an attempt keeps of its agent's error: type, message and stack (as the Python runner keeps). */
export function errorRecord(error: unknown): JsonObject {
  const err = error instanceof Error ? error : new Error(String(error));
  const stack = err.stack ?? "";
  return {
    type: err.name,
    message: err.message.slice(0, 2000),
    traceback: stack.length > 8000 ? `…${stack.slice(-7999)}` : stack,
  };
}
