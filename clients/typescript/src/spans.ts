/**
 * Spans: building them (ids, timing, attributes named by `semconv.ts`) and sending them over the Store's
 * bidirectional span stream.
 *
 * `SpanStream` mirrors the Python client's shipper: spans are queued per attempt and cut into batches; a
 * batch stays in memory until the Store acknowledges it (which it does once the batch is stored); when
 * the stream breaks it is opened again and every unacknowledged batch is sent again (the Store keys spans
 * by span id, so a batch sent twice is stored once). A batch the Store refuses with a transient error
 * (its in-memory store full, out of space) is sent again after a back-off; any other refusal gives it up,
 * counted in `stats`.
 */
import { create } from "@bufbuild/protobuf";
import { createHash, randomBytes } from "node:crypto";
import type { StoreClient } from "./client.js";
import { sleep } from "./client.js";
import { TRANSIENT_REASONS, errorFromStatus, fromConnectError, type LightningError } from "./errors.js";
import { SpanKind, SpanSchema, SpanStatusCode, type Span } from "./gen/lightning/v1/span_pb.js";
import { attributes, type AttributeValue } from "./semconv.js";
import {
  AddSpansStreamRequestSchema as SpanStreamRequest,
  type AddSpansStreamRequest,
  type AddSpansStreamResponse,
} from "./gen/lightning/v1/store_service_pb.js";

/** The trace id of a rollout's spans, the same for each of its attempts (semconv.rollout_trace_id). */
export function rolloutTraceId(rolloutId: string): string {
  const hex = createHash("sha256").update(rolloutId).digest("hex").slice(0, 32);
  return /^0+$/.test(hex) ? "0".repeat(31) + "1" : hex;
}

export function newSpanId(): string {
  return randomBytes(8).toString("hex");
}

export function nowNanos(): bigint {
  return BigInt(Date.now()) * 1_000_000n + (process.hrtime.bigint() % 1_000_000n);
}

export interface SpanInit {
  name: string;
  rolloutId: string;
  attemptId: string;
  traceId: string;
  parentSpanId?: string;
  spanId?: string;
  start?: bigint;
  end?: bigint;
  attributes?: Record<string, AttributeValue>;
  error?: string;
}

/** A finished span of an attempt (the Store assigns its sequence id). */
export function makeSpan(init: SpanInit): Span {
  const start = init.start ?? nowNanos();
  return create(SpanSchema, {
    rolloutId: init.rolloutId,
    attemptId: init.attemptId,
    traceId: init.traceId,
    spanId: init.spanId ?? newSpanId(),
    parentSpanId: init.parentSpanId ?? "",
    name: init.name,
    kind: SpanKind.INTERNAL,
    startTimeUnixNano: start,
    endTimeUnixNano: init.end ?? nowNanos(),
    status: init.error
      ? { code: SpanStatusCode.ERROR, message: init.error.slice(0, 1000) }
      : { code: SpanStatusCode.OK },
    attributes: attributes(init.attributes ?? {}),
  });
}

// ==================================================================== the span stream
interface Batch {
  readonly id: bigint;
  readonly key: string;
  readonly rolloutId: string;
  readonly attemptId: string;
  readonly spans: Span[];
}

export interface SpanStreamStats {
  submitted: number;
  stored: number;
  duplicates: number;
  givenUp: number;
  reconnects: number;
}

export interface SpanStreamOptions {
  /** Spans per batch (default 64). */
  maxBatch?: number;
  /** Batches sent and not yet acknowledged (default 32). */
  window?: number;
  /** How long spans wait to fill a batch, in seconds (default 0.02). */
  linger?: number;
  /** Called with each batch given up and why. */
  onGivenUp?: (spans: Span[], error: LightningError) => void;
}

/** Ships spans to the Store over `AddSpansStream`: acknowledged batches, resent after a reconnect. */
export class SpanStream {
  readonly stats: SpanStreamStats = { submitted: 0, stored: 0, duplicates: 0, givenUp: 0, reconnects: 0 };
  private readonly queued = new Map<string, Span[]>();
  private readonly outbox: Batch[] = [];
  private readonly unacked = new Map<bigint, Batch>();
  private readonly pendingByKey = new Map<string, number>();
  private readonly waiters = new Set<() => void>();
  private nextBatchId = 1n;
  private wake: (() => void) | undefined;
  private closed = false;
  private abort = new AbortController();
  private loop: Promise<void> | undefined;
  private readonly maxBatch: number;
  private readonly window: number;
  private readonly lingerMs: number;

  constructor(private readonly client: StoreClient, private readonly options: SpanStreamOptions = {}) {
    this.maxBatch = options.maxBatch ?? 64;
    this.window = options.window ?? 32;
    this.lingerMs = Math.round((options.linger ?? 0.02) * 1000);
  }

  /** Queue one span of an attempt; it is sent soon, batched with others of the same attempt. */
  submit(span: Span): void {
    if (this.closed) throw new Error("the span stream is closed");
    const key = `${span.rolloutId}\u0000${span.attemptId}`;
    let list = this.queued.get(key);
    if (!list) this.queued.set(key, (list = []));
    list.push(span);
    this.stats.submitted++;
    this.pendingByKey.set(key, (this.pendingByKey.get(key) ?? 0) + 1);
    this.loop ??= this.run();
    if (list.length >= this.maxBatch) this.cut();
    else setTimeout(() => this.cut(), this.lingerMs).unref();
  }

  /** Spans submitted and not yet stored or given up (of one attempt, or of all). */
  pending(rolloutId?: string, attemptId?: string): number {
    if (rolloutId === undefined) return [...this.pendingByKey.values()].reduce((a, b) => a + b, 0);
    return this.pendingByKey.get(`${rolloutId}\u0000${attemptId ?? ""}`) ?? 0;
  }

  /** Wait until every span of the attempt (or every span) is stored or given up, up to `timeout` seconds; false on timeout. */
  async flush(rolloutId?: string, attemptId?: string, timeout = 30): Promise<boolean> {
    this.cut();
    const deadline = Date.now() + timeout * 1000;
    while (this.pending(rolloutId, attemptId) > 0) {
      const left = deadline - Date.now();
      if (left <= 0) return false;
      await new Promise<void>((resolve) => {
        const timer = setTimeout(finish, Math.min(left, 1000));
        function finish() {
          clearTimeout(timer);
          resolve();
        }
        this.waiters.add(finish);
      });
    }
    return true;
  }

  /** Flush (up to `timeout` seconds), then stop the stream. */
  async close(timeout = 10): Promise<void> {
    await this.flush(undefined, undefined, timeout);
    this.closed = true;
    this.abort.abort();
    this.poke();
    await this.loop;
  }

  private cut(): void {
    for (const [key, spans] of this.queued) {
      while (spans.length > 0) {
        const chunk = spans.splice(0, this.maxBatch);
        const first = chunk[0] as Span;
        this.outbox.push({ id: this.nextBatchId++, key, rolloutId: first.rolloutId, attemptId: first.attemptId, spans: chunk });
      }
      this.queued.delete(key);
    }
    this.poke();
  }

  private poke(): void {
    const wake = this.wake;
    this.wake = undefined;
    wake?.();
  }

  private notify(): void {
    for (const waiter of [...this.waiters]) {
      this.waiters.delete(waiter);
      waiter();
    }
  }

  private finish(batch: Batch, spans: number): void {
    this.unacked.delete(batch.id);
    const left = (this.pendingByKey.get(batch.key) ?? 0) - spans;
    if (left > 0) this.pendingByKey.set(batch.key, left);
    else this.pendingByKey.delete(batch.key);
    this.notify();
    this.poke(); // room in the window: the sender may go on
  }

  private async *requests(session: AbortSignal): AsyncIterable<AddSpansStreamRequest> {
    // After a reconnect, everything not acknowledged goes first, in order.
    const resend = [...this.unacked.values()].sort((a, b) => (a.id < b.id ? -1 : 1));
    for (const batch of resend) {
      yield create(SpanStreamRequest, { batchId: batch.id, rolloutId: batch.rolloutId, attemptId: batch.attemptId, spans: batch.spans });
    }
    while (!session.aborted) {
      const batch = this.unacked.size < this.window ? this.outbox.shift() : undefined;
      if (batch === undefined) {
        if (this.closed && this.unacked.size === 0) return;
        await new Promise<void>((resolve) => {
          this.wake = resolve;
          session.addEventListener("abort", () => resolve(), { once: true });
        });
        continue;
      }
      this.unacked.set(batch.id, batch);
      yield create(SpanStreamRequest, { batchId: batch.id, rolloutId: batch.rolloutId, attemptId: batch.attemptId, spans: batch.spans });
    }
  }

  private acknowledge(ack: AddSpansStreamResponse): void {
    const batch = this.unacked.get(ack.batchId);
    if (batch === undefined) return; // an acknowledgement of a batch already settled (sent twice)
    if (!ack.error || ack.error.code === 0) {
      this.stats.stored += ack.storedCount;
      this.stats.duplicates += ack.duplicateCount;
      this.finish(batch, batch.spans.length);
      return;
    }
    const { reason, message } = ack.error;
    if (TRANSIENT_REASONS.has(reason)) {
      this.unacked.delete(batch.id);
      setTimeout(() => {
        this.outbox.unshift(batch);
        this.poke();
      }, 500).unref();
      return;
    }
    this.stats.givenUp += batch.spans.length;
    this.options.onGivenUp?.(batch.spans, errorFromStatus(ack.error.code, message, reason));
    this.finish(batch, batch.spans.length);
  }

  private async run(): Promise<void> {
    let backoff = 100;
    while (!this.closed || this.unacked.size > 0 || this.outbox.length > 0) {
      if (this.abort.signal.aborted && this.closed) return;
      const session = new AbortController();
      const stop = () => session.abort();
      this.abort.signal.addEventListener("abort", stop, { once: true });
      try {
        for await (const ack of this.client.raw.addSpansStream(this.requests(session.signal), { signal: session.signal, timeoutMs: 0 })) {
          backoff = 100;
          this.acknowledge(ack);
        }
        if (this.closed) return;
      } catch (error) {
        if (this.closed && this.abort.signal.aborted) return;
        const typed = fromConnectError(error);
        if (!typed.transient && typed.codeName !== "UNKNOWN" && typed.codeName !== "CANCELLED") {
          // The stream itself was refused (a bad credential): give up what it carried.
          for (const batch of [...this.unacked.values(), ...this.outbox.splice(0)]) {
            this.stats.givenUp += batch.spans.length;
            this.options.onGivenUp?.(batch.spans, typed);
            this.finish(batch, batch.spans.length);
          }
        }
      } finally {
        this.abort.signal.removeEventListener("abort", stop);
        session.abort();
      }
      if (this.closed && this.unacked.size === 0 && this.outbox.length === 0) return;
      this.stats.reconnects++;
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 5000);
    }
  }
}
