/**
 * RunnerSession: a runner's claims, heartbeats and reports as messages of one RunnerSession stream, as the
 * Python client's `lightning_grpc.client.RunnerSession`.
 *
 * Each message is answered on its own as soon as the server is done with it, so any number of calls may
 * share one session. When the stream breaks (UNAVAILABLE: the server restarts, a standby takes over) the
 * session opens a new one and sends again every message it has no answer to; all are safe to repeat (a
 * claim carries a request id, a report is fenced by its attempt). A server without RunnerSession (an older
 * release, UNIMPLEMENTED) is asked with the unary RPCs instead. A stream that stays open but answers
 * nothing (no answer to any message since one that went unanswered for its whole timeout was sent) is given
 * up: that call fails with DeadlineExceededError, and a new stream takes every message still owed.
 */
import { create } from "@bufbuild/protobuf";
import { Code, type Client } from "@connectrpc/connect";
import { DeadlineExceededError, errorFromStatus, fromConnectError, UnavailableError, type LightningError } from "./errors.js";
import {
  RunnerSessionRequestSchema,
  type RunnerSessionRequest,
  type RunnerSessionResponse,
  type StoreService,
} from "./gen/lightning/v1/store_service_pb.js";
import { RunnerCalls, unaryRunnerCall, type RunnerCall, type RunnerCallOptions, type RunnerRequests, type RunnerResponses } from "./runner_calls.js";
import type { RetryConfig } from "./client.js";

interface Owed {
  readonly message: RunnerSessionRequest;
  readonly settle: (answer: RunnerSessionResponse | typeof UNARY | LightningError) => void;
  /** When it was last handed to a stream (performance.now()); 0: not yet. */
  sentAt: number;
}

/** The answer that says: ask this message's unary RPC instead (the server has no RunnerSession). */
const UNARY = Symbol("unary");

/**
 * The runner's calls of a StoreClient over one RunnerSession stream: `dequeueRollouts`, `dequeueRollout`,
 * `heartbeatAttempt`, `completeAttempt`, `updateAttempt` and `completeAndDequeue`, with the client's
 * arguments, answers and typed errors. Made by `StoreClient.runnerSession()`; call `close()` when done
 * (an open stream keeps the process's connection busy).
 */
export class RunnerSession extends RunnerCalls {
  protected readonly callTimeout: number;
  private readonly retry: RetryConfig | null;
  private nextId = 1n;
  private readonly owed = new Map<bigint, Owed>();
  /** Messages for the stream now open, in the order they were sent. */
  private readonly outbox: RunnerSessionRequest[] = [];
  private wake?: () => void;
  private loop?: Promise<void>;
  private unary = false;
  private closed = false;
  private readonly abort = new AbortController();
  /** The stream now open, when it last answered (or opened), and whether it was given up as silent. */
  private stream?: AbortController;
  private answeredAt = 0;
  private givenUp = false;

  constructor(
    private readonly raw: Client<typeof StoreService>,
    config: { readonly timeout: number; readonly retry: RetryConfig | null },
  ) {
    super();
    this.callTimeout = config.timeout;
    this.retry = config.retry;
  }

  /** End the stream; calls still waiting for their answer fail with UnavailableError (SESSION_CLOSED). */
  async close(): Promise<void> {
    this.closed = true;
    this.settleAll(closedError());
    this.abort.abort();
    this.poke();
    await this.loop;
  }

  protected async send<K extends RunnerCall>(call: K, request: RunnerRequests[K], options: RunnerCallOptions): Promise<RunnerResponses[K]> {
    if (this.closed) throw closedError();
    if (this.unary) return unaryRunnerCall(this.raw, call, request, options);
    const id = this.nextId++;
    const message = create(RunnerSessionRequestSchema, {
      messageId: id,
      call: { case: call, value: request } as RunnerSessionRequest["call"],
    });
    let timer: NodeJS.Timeout | undefined;
    let onAbort: (() => void) | undefined;
    const answer = new Promise<RunnerSessionResponse | typeof UNARY | LightningError>((resolve) => {
      const settle = (got: RunnerSessionResponse | typeof UNARY | LightningError) => {
        this.owed.delete(id); // settled: not sent again on a new stream
        resolve(got);
      };
      const owed: Owed = { message, settle, sentAt: 0 };
      this.owed.set(id, owed);
      timer = setTimeout(() => {
        settle(new DeadlineExceededError(`no answer to ${call} on the runner session in time`));
        this.giveUpIfSilent(owed.sentAt, options.timeoutMs);
      }, options.timeoutMs);
      onAbort = () => settle(fromConnectError(options.signal?.reason ?? new Error("aborted")));
      options.signal?.addEventListener("abort", onAbort, { once: true });
    });
    this.outbox.push(message);
    this.poke();
    this.loop ??= this.run();
    let got: RunnerSessionResponse | typeof UNARY | LightningError;
    try {
      got = await answer;
    } finally {
      clearTimeout(timer);
      if (onAbort) options.signal?.removeEventListener("abort", onAbort);
    }
    if (got === UNARY) return unaryRunnerCall(this.raw, call, request, options);
    if (got instanceof Error) throw got;
    if (got.result.case === "error") {
      const { code, message: text, reason } = got.result.value;
      throw errorFromStatus(code, text, reason);
    }
    if (got.result.case !== call) throw new UnavailableError(`the runner session answered ${call} with ${got.result.case ?? "nothing"}`);
    return got.result.value as RunnerResponses[K];
  }

  /** After a message sent at `sentAt` went unanswered for its whole timeout: a stream that has answered
   * nothing since, and nothing for half that timeout at least (not one just opened), is given up, and `run`
   * opens another at once. */
  private giveUpIfSilent(sentAt: number, timeoutMs: number): void {
    if (this.closed || !this.stream || sentAt === 0 || this.answeredAt > sentAt) return;
    if (performance.now() - this.answeredAt < timeoutMs / 2) return;
    this.givenUp = true;
    this.stream.abort();
  }

  private poke(): void {
    const wake = this.wake;
    this.wake = undefined;
    wake?.();
  }

  private settleAll(answer: typeof UNARY | LightningError): void {
    for (const owed of [...this.owed.values()]) owed.settle(answer);
    this.outbox.length = 0;
  }

  /** The messages of one stream: first every one still owed (a new stream sends them again), then new ones. */
  private async *requests(stream: AbortSignal): AsyncIterable<RunnerSessionRequest> {
    this.outbox.length = 0; // all of them are owed, and sent below
    for (const id of [...this.owed.keys()].sort((a, b) => (a < b ? -1 : 1))) {
      const owed = this.owed.get(id);
      if (owed) {
        owed.sentAt = performance.now();
        yield owed.message;
      }
    }
    while (!stream.aborted && !this.closed) {
      const message = this.outbox.shift();
      if (message === undefined) {
        await new Promise<void>((resolve) => {
          this.wake = resolve;
          stream.addEventListener("abort", () => resolve(), { once: true });
        });
        continue;
      }
      const owed = this.owed.get(message.messageId);
      if (owed) {
        // not one that timed out meanwhile
        owed.sentAt = performance.now();
        yield message;
      }
    }
  }

  /** Streams, one after another while they break (UNAVAILABLE, with back-off); answers settle their calls. */
  private async run(): Promise<void> {
    let failures = 0;
    for (;;) {
      const stream = new AbortController();
      this.stream = stream;
      this.answeredAt = performance.now();
      this.givenUp = false;
      const stop = () => stream.abort();
      this.abort.signal.addEventListener("abort", stop, { once: true });
      let error: LightningError | undefined;
      try {
        for await (const answer of this.raw.runnerSession(this.requests(stream.signal), { signal: stream.signal, timeoutMs: 0 })) {
          failures = 0;
          this.answeredAt = performance.now();
          this.owed.get(answer.messageId)?.settle(answer);
        }
      } catch (caught) {
        error = fromConnectError(caught);
      } finally {
        this.abort.signal.removeEventListener("abort", stop);
        stream.abort();
        this.stream = undefined;
      }
      if (this.closed) return;
      if (this.givenUp) continue; // silent, not broken: another stream at once, with every message owed
      if (error?.code === Code.Unimplemented) {
        this.unary = true; // an older server: every message, owed or to come, is its unary call
        this.settleAll(UNARY);
        return;
      }
      failures++;
      const retry = this.retry;
      if ((error && !(error instanceof UnavailableError)) || !retry || failures >= retry.maxAttempts) {
        this.settleAll(error ?? new UnavailableError("the server ended the runner session", { reason: "SESSION_ENDED" }));
        this.loop = undefined; // a message sent from now on opens a new stream
        return;
      }
      const backoff = Math.min(retry.maxBackoffMs, retry.initialBackoffMs * retry.backoffMultiplier ** (failures - 1));
      await new Promise<void>((resolve) => setTimeout(resolve, backoff));
      if (this.closed) return;
    }
  }
}

function closedError(): UnavailableError {
  return new UnavailableError("the runner session was closed", { reason: "SESSION_CLOSED" });
}
