/**
 * The TypeScript client against a real server: every kind of StoreService call (unary, server stream,
 * bidirectional stream), typed errors from ErrorInfo, and credentials.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { join } from "node:path";
import { Code, ConnectError } from "@connectrpc/connect";
import {
  AbortedError,
  AttemptStatus,
  InvalidArgumentError,
  NotFoundError,
  PermissionDeniedError,
  RolloutStatus,
  SpanStream,
  StoreClient,
  UnauthenticatedError,
  UnavailableError,
  fromConnectError,
  inputOf,
  makeSpan,
  rolloutTraceId,
  semconv,
  type Span,
} from "../src/index.js";
import { eventually, startRelay, startServer, tempDir, type Server } from "./helpers.js";

describe("a server without auth", () => {
  let server: Server;
  let client: StoreClient;
  before(async () => {
    server = await startServer();
    client = new StoreClient(server.address);
  });
  after(async () => {
    await server.stop();
  });

  test("unary calls: enqueue, get, list, dequeue, heartbeat, complete, statistics", async () => {
    const queued = await client.enqueueRollout({ question: "2+2", answer: 4 }, { groupId: "g-unary" });
    assert.equal(queued.status, RolloutStatus.QUEUING);
    assert.deepEqual(inputOf(await client.getRollout(queued.rolloutId)), { question: "2+2", answer: 4 });
    const listed = await client.queryRollouts({ groupId: "g-unary", statusIn: [RolloutStatus.QUEUING] });
    assert.deepEqual(listed.map((r) => r.rolloutId), [queued.rolloutId]);

    const [claimed] = await client.dequeueRollouts(1, { workerId: "ts-worker" });
    assert.ok(claimed && claimed.latestAttempt);
    assert.equal(claimed.rolloutId, queued.rolloutId);
    assert.equal(claimed.latestAttempt.workerId, "ts-worker");
    const beat = await client.heartbeatAttempt(claimed.rolloutId, claimed.latestAttempt.attemptId);
    assert.equal(beat.shouldStop, false);
    assert.equal(beat.attempt.status, AttemptStatus.RUNNING);
    const [attempt, done] = await client.completeAttempt(claimed.rolloutId, claimed.latestAttempt.attemptId, AttemptStatus.SUCCEEDED);
    assert.equal(attempt.status, AttemptStatus.SUCCEEDED);
    assert.equal(done.status, RolloutStatus.SUCCEEDED);
    assert.equal(await client.getRolloutById("ro-no-such"), undefined);
    const page = await client.listRollouts({ groupId: "g-unary", pageSize: 1, descending: true });
    assert.equal(page.totalSize, 1n);
    assert.deepEqual(page.items.map((r) => r.rolloutId), [queued.rolloutId]);

    const stats = await client.statistics();
    assert.ok(stats.totalRollouts >= 1n);
    assert.ok((stats.rolloutsByStatus["ROLLOUT_STATUS_SUCCEEDED"] ?? 0n) >= 1n);
  });

  test("a long-poll dequeue answers as soon as a rollout is queued", async () => {
    const started = Date.now();
    const waiting = client.dequeueRollouts(1, { workerId: "ts-poller", wait: 10 });
    await new Promise((r) => setTimeout(r, 300));
    const queued = await client.enqueueRollout("late");
    const [got] = await waiting;
    assert.equal(got?.rolloutId, queued.rolloutId);
    assert.ok(Date.now() - started < 8000, "the dequeue waited out its whole wait");
    const empty = await client.dequeueRollouts(1, { workerId: "ts-poller", wait: 0.3 });
    assert.deepEqual(empty, []);
  });

  test("server streams: WatchRollouts sees a change live, TailSpans follows new spans", async () => {
    const watching = new AbortController();
    const seen: string[] = [];
    const watch = (async () => {
      for await (const event of client.watchRollouts("", { signal: watching.signal })) {
        if (event.rollout?.groupId === "g-watch") seen.push(event.rollout.rolloutId);
      }
    })();
    await new Promise((r) => setTimeout(r, 200));
    const rollout = await client.enqueueRollout("watched", { groupId: "g-watch" });
    await eventually("the watch event", async () => (seen.includes(rollout.rolloutId) ? true : undefined));
    watching.abort();
    await watch;

    const running = await client.startRollout("tailed", { workerId: "ts-tail" });
    const attemptId = running.latestAttempt!.attemptId;
    const tailing = new AbortController();
    const names: string[] = [];
    const tail = (async () => {
      for await (const batch of client.tailSpans(running.rolloutId, undefined, { follow: true, signal: tailing.signal })) {
        names.push(...batch.map((span) => span.name));
      }
    })().catch((error: unknown) => {
      if (!tailing.signal.aborted) throw error;
    });
    const traceId = rolloutTraceId(running.rolloutId);
    const first = await client.addSpans([makeSpan({ name: "first", rolloutId: running.rolloutId, attemptId, traceId })]);
    assert.equal(first.storedCount, 1);
    await eventually("the first tailed span", async () => (names.includes("first") ? true : undefined));
    await client.addSpans([makeSpan({ name: "second", rolloutId: running.rolloutId, attemptId, traceId })], { rolloutId: running.rolloutId, attemptId });
    await eventually("the second tailed span", async () => (names.includes("second") ? true : undefined));
    tailing.abort();
    await tail;
  });

  test("the bidirectional span stream stores every batch once, and gives up only a refused one", async () => {
    const running = await client.startRollout("streamed", { workerId: "ts-stream" });
    const attemptId = running.latestAttempt!.attemptId;
    const traceId = rolloutTraceId(running.rolloutId);
    const givenUp: string[] = [];
    const stream = new SpanStream(client, { maxBatch: 16, onGivenUp: (spans, error) => givenUp.push(`${spans.length}:${error.reason}`) });
    for (let i = 0; i < 100; i++) {
      stream.submit(makeSpan({ name: `s${i}`, rolloutId: running.rolloutId, attemptId, traceId, attributes: { i } }));
    }
    stream.submit(makeSpan({ name: "orphan", rolloutId: running.rolloutId, attemptId: "no-such-attempt", traceId }));
    assert.equal(await stream.flush(undefined, undefined, 20), true);
    await stream.close();
    const stored = await client.querySpans(running.rolloutId);
    assert.equal(stored.length, 100);
    assert.deepEqual(new Set(stored.map((s) => s.name)).size, 100);
    assert.ok(stored.every((s, i) => i === 0 || s.sequenceId > (stored[i - 1] as Span).sequenceId), "sequence ids grow");
    assert.equal(stream.stats.stored, 100);
    assert.deepEqual(givenUp, ["1:ATTEMPT_NOT_FOUND"]);
  });

  test("a connection reset under a batch in flight is a lost connection: the batch is sent again, none given up", async () => {
    const relay = await startRelay(server.address);
    const through = new StoreClient({ target: relay.address, timeout: 5 });
    try {
      const running = await through.startRollout("reset", { workerId: "ts-reset" });
      const attemptId = running.latestAttempt!.attemptId;
      const traceId = rolloutTraceId(running.rolloutId);
      const givenUp: string[] = [];
      const stream = new SpanStream(through, { onGivenUp: (spans, error) => givenUp.push(`${spans.length}:${error.codeName}:${error.message}`) });
      const span = (name: string) => makeSpan({ name, rolloutId: running.rolloutId, attemptId, traceId });
      stream.submit(span("before"));
      assert.equal(await stream.flush(undefined, undefined, 10), true);
      relay.hold();
      stream.submit(span("across")); // sent, and held unanswered when the connection breaks
      await new Promise((r) => setTimeout(r, 300));
      assert.equal(stream.pending(), 1);
      assert.ok(relay.reset() >= 1, "the stream's connection goes through the relay");
      assert.equal(await stream.flush(undefined, undefined, 20), true);
      await stream.close();
      assert.deepEqual(givenUp, []);
      assert.ok(stream.stats.reconnects >= 1, JSON.stringify(stream.stats));
      const names = (await client.querySpans(running.rolloutId)).map((s) => s.name).sort();
      assert.deepEqual(names, ["across", "before"]);
    } finally {
      await relay.close();
    }
  });

  test("a reset connection is UNAVAILABLE (transient); a server's ABORTED stays ABORTED", () => {
    const reset = Object.assign(new Error("read ECONNRESET"), { code: "ECONNRESET", syscall: "read" });
    const lost = fromConnectError(new ConnectError("read ECONNRESET", Code.Aborted, undefined, undefined, reset));
    assert.ok(lost instanceof UnavailableError && lost.transient, `${lost.name}: ${lost.message}`);
    const refused = fromConnectError(new ConnectError("the attempt changed", Code.Aborted));
    assert.ok(refused instanceof AbortedError && !refused.transient, refused.name);
  });

  test("typed errors carry the ErrorInfo reason, metadata and field", async () => {
    await assert.rejects(client.getRollout("ro-missing"), (error: unknown) => {
      assert.ok(error instanceof NotFoundError);
      assert.equal(error.reason, "ROLLOUT_NOT_FOUND");
      assert.equal(error.metadata["rolloutId"], "ro-missing");
      assert.equal(error.transient, false);
      return true;
    });
    await assert.rejects(client.dequeueRollouts(-1), (error: unknown) => {
      assert.ok(error instanceof InvalidArgumentError, String(error));
      assert.match(error.field, /max_rollouts/);
      return true;
    });
    const nowhere = new StoreClient({ target: "127.0.0.1:9", retry: { maxAttempts: 2, initialBackoffMs: 10, maxBackoffMs: 10, backoffMultiplier: 1 }, timeout: 2 });
    await assert.rejects(nowhere.statistics(), (error: unknown) => error instanceof UnavailableError && error.transient);
  });
});

describe("a span stream across a server restart", () => {
  test("batches not acknowledged before the server went away are sent again and stored once", async () => {
    const dir = tempDir();
    const db = join(dir, "store.db");
    let server = await startServer(["--db", db]);
    const port = server.address.split(":").pop()!;
    const client = new StoreClient({ target: server.address, timeout: 5 });
    const running = await client.startRollout("resent", { workerId: "ts-restart" });
    const attemptId = running.latestAttempt!.attemptId;
    const traceId = rolloutTraceId(running.rolloutId);
    const stream = new SpanStream(client);
    const span = (name: string) => makeSpan({ name, rolloutId: running.rolloutId, attemptId, traceId });
    stream.submit(span("before"));
    assert.equal(await stream.flush(undefined, undefined, 10), true);
    await server.stop();
    for (let i = 0; i < 10; i++) stream.submit(span(`during-${i}`));
    await new Promise((r) => setTimeout(r, 500));
    assert.ok(stream.pending() > 0, "nothing can be stored while the server is down");
    server = await startServer(["--db", db, "--port", port]);
    try {
      assert.equal(await stream.flush(undefined, undefined, 30), true);
      await stream.close();
      const names = (await client.querySpans(running.rolloutId)).map((s) => s.name).sort();
      assert.deepEqual(names, ["before", ...Array.from({ length: 10 }, (_, i) => `during-${i}`)].sort());
      assert.ok(stream.stats.reconnects >= 1);
    } finally {
      await server.stop();
    }
  });
});

describe("a server with auth", () => {
  let server: Server;
  const token = "ts-admin-token-0123456789";
  before(async () => {
    server = await startServer(["--token", token]);
  });
  after(async () => {
    await server.stop();
  });

  test("no credential is UNAUTHENTICATED; an attempt credential is refused on another attempt", async () => {
    await assert.rejects(new StoreClient(server.address).statistics(), (error: unknown) => {
      assert.ok(error instanceof UnauthenticatedError);
      assert.equal(error.reason, "BAD_TOKEN");
      return true;
    });
    const admin = new StoreClient({ target: server.address, token });
    const a = await admin.startRollout("a", { workerId: "w" });
    const b = await admin.startRollout("b", { workerId: "w" });
    const credential = a.latestAttempt!.credential;
    assert.ok(credential, "the Store mints an attempt credential");
    const agent = new StoreClient({ target: server.address, token: credential });
    await agent.heartbeatAttempt(a.rolloutId, a.latestAttempt!.attemptId);
    await assert.rejects(agent.heartbeatAttempt(b.rolloutId, b.latestAttempt!.attemptId), (error: unknown) => {
      assert.ok(error instanceof PermissionDeniedError);
      assert.equal(error.reason, "WRONG_ATTEMPT");
      return true;
    });
    await assert.rejects(agent.enqueueRollout("x"), (error: unknown) => error instanceof PermissionDeniedError && error.reason === "ROLE_NOT_ALLOWED");
    const traceId = rolloutTraceId(b.rolloutId);
    await assert.rejects(
      agent.addSpans([makeSpan({ name: semconv.SPAN_REWARD, rolloutId: b.rolloutId, attemptId: b.latestAttempt!.attemptId, traceId })]),
      (error: unknown) => error instanceof PermissionDeniedError,
    );
    assert.equal((await admin.querySpans(b.rolloutId)).length, 0, "nothing recorded on the refused attempt");
  });
});
