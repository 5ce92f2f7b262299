/**
 * RunnerSession against a real server: a runner's calls as messages of one stream, answered as the unary
 * calls are; a broken connection resends what is owed; an older server (no RunnerSession) gets unary calls.
 */
import assert from "node:assert/strict";
import { createServer, type Http2Server, type ServerHttp2Session } from "node:http2";
import { after, before, describe, test } from "node:test";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import type { ServiceImpl } from "@connectrpc/connect";
import {
  AttemptStatus,
  DeadlineExceededError,
  FailedPreconditionError,
  NotFoundError,
  RolloutStatus,
  StoreClient,
  StoreService,
  UnavailableError,
  inputOf,
  makeSpan,
  rolloutTraceId,
} from "../src/index.js";
import { startRelay, startServer, type Server } from "./helpers.js";

describe("a runner session", () => {
  let server: Server;
  let client: StoreClient;
  before(async () => {
    server = await startServer();
    client = new StoreClient(server.address);
  });
  after(async () => {
    await server.stop();
  });

  test("a rollout's claim, heartbeat and reports answer as the client's own calls", async () => {
    const session = client.runnerSession();
    try {
      const [first, second] = await client.enqueueRollouts([{ input: "one", groupId: "g-session" }, { input: "two", groupId: "g-session" }]);
      const got = await session.dequeueRollout({ workerId: "ts-session" });
      assert.equal(got?.rolloutId, first?.rolloutId);
      assert.equal(got?.latestAttempt?.workerId, "ts-session");
      const attemptId = got!.latestAttempt!.attemptId;
      const beat = await session.heartbeatAttempt(got!.rolloutId, attemptId);
      assert.equal(beat.shouldStop, false);
      assert.equal(beat.attempt.status, AttemptStatus.RUNNING);

      const traceId = rolloutTraceId(got!.rolloutId);
      const spans = [makeSpan({ name: "step", rolloutId: got!.rolloutId, attemptId, traceId })];
      const [attempt, done, next] = await session.completeAndDequeue(got!.rolloutId, attemptId, AttemptStatus.SUCCEEDED, {
        spans,
        workerId: "ts-session",
      });
      assert.equal(attempt.status, AttemptStatus.SUCCEEDED);
      assert.equal(done.status, RolloutStatus.SUCCEEDED);
      assert.deepEqual(next.map((r) => r.rolloutId), [second?.rolloutId]);
      assert.equal(inputOf(next[0]!), "two");
      assert.deepEqual((await client.querySpans(got!.rolloutId)).map((s) => s.name), ["step"]);

      const nextAttempt = next[0]!.latestAttempt!.attemptId;
      const [failed] = await session.completeAttempt(next[0]!.rolloutId, nextAttempt, AttemptStatus.FAILED, "no answer");
      assert.equal(failed.status, AttemptStatus.FAILED);
      assert.equal(failed.statusMessage, "no answer");
      // Errors are the unary calls' typed errors, and the session goes on after them.
      await assert.rejects(session.heartbeatAttempt("ro-no-such", "at-no-such"), NotFoundError);
      await assert.rejects(session.completeAttempt(next[0]!.rolloutId, nextAttempt, AttemptStatus.SUCCEEDED), FailedPreconditionError);
      assert.equal((await session.heartbeatAttempt(got!.rolloutId, attemptId)).shouldStop, true);
    } finally {
      await session.close();
    }
  });

  test("many calls at once share one session, each answered with its own claim", async () => {
    const queued = await client.enqueueRollouts(Array.from({ length: 20 }, (_, i) => ({ input: i, groupId: "g-many" })));
    const session = client.runnerSession();
    try {
      const claims = await Promise.all(queued.map((_, i) => session.dequeueRollout({ workerId: `ts-many-${i % 4}` })));
      const ids = claims.map((r) => r?.rolloutId);
      assert.equal(new Set(ids).size, 20);
      assert.deepEqual([...ids].sort(), queued.map((r) => r.rolloutId).sort());
      const reports = await Promise.all(
        claims.map((r) => session.completeAttempt(r!.rolloutId, r!.latestAttempt!.attemptId, AttemptStatus.SUCCEEDED)),
      );
      assert.ok(reports.every(([, rollout]) => rollout.status === RolloutStatus.SUCCEEDED));
    } finally {
      await session.close();
    }
  });

  test("a claim owed when the connection breaks is sent again on a new stream and answered", async () => {
    const relay = await startRelay(server.address);
    const through = new StoreClient({ target: relay.address, timeout: 5 });
    const session = through.runnerSession();
    try {
      assert.deepEqual(await session.dequeueRollouts(1, { workerId: "ts-reset", wait: 0.1 }), []); // the stream is open
      const claim = session.dequeueRollout({ workerId: "ts-reset", wait: 10 });
      await new Promise((r) => setTimeout(r, 300));
      assert.ok(relay.reset() >= 1, "no connection went through the relay");
      await new Promise((r) => setTimeout(r, 500));
      const queued = await client.enqueueRollout("after the break");
      const got = await claim;
      assert.equal(got?.rolloutId, queued.rolloutId);
      assert.equal(got?.latestAttempt?.workerId, "ts-reset");
    } finally {
      await session.close();
      await relay.close();
    }
  });

  test("close fails the calls still waiting with UnavailableError (SESSION_CLOSED), and later calls too", async () => {
    const session = client.runnerSession();
    const waiting = session.dequeueRollouts(1, { workerId: "ts-close", wait: 10 });
    await new Promise((r) => setTimeout(r, 200));
    await session.close();
    await assert.rejects(waiting, (error: unknown) => error instanceof UnavailableError && error.reason === "SESSION_CLOSED");
    await assert.rejects(session.heartbeatAttempt("ro-x", "at-x"), (error: unknown) => error instanceof UnavailableError && error.reason === "SESSION_CLOSED");
  });
});

/** A real server, and in front of it an HTTP/2 server on 127.0.0.1 whose StoreService is `handlers` (given a
 * client of the real one); every other method answers UNIMPLEMENTED. `close` stops both. */
interface Front {
  readonly server: Server;
  readonly address: string;
  close(): Promise<void>;
}
async function serveInFront(handlers: (store: StoreClient) => Partial<ServiceImpl<typeof StoreService>>): Promise<Front> {
  const server = await startServer();
  const store = new StoreClient(server.address);
  const sessions = new Set<ServerHttp2Session>();
  const front: Http2Server = createServer(connectNodeAdapter({ routes: (router) => router.service(StoreService, handlers(store)) }));
  front.on("session", (session) => sessions.add(session));
  await new Promise<void>((resolve) => front.listen(0, "127.0.0.1", resolve));
  const bound = front.address();
  return {
    server,
    address: `127.0.0.1:${typeof bound === "object" && bound ? bound.port : 0}`,
    close: async () => {
      const closed = new Promise<void>((resolve) => front.close(() => resolve()));
      for (const session of sessions) session.destroy();
      await closed;
      await server.stop();
    },
  };
}

describe("a server without RunnerSession (an older release)", () => {
  let older: Front;
  before(async () => {
    // The unary RPCs a runner calls, passed on to a real server; every other method answers UNIMPLEMENTED.
    older = await serveInFront((store) => ({
      enqueueRollouts: (req) => store.raw.enqueueRollouts(req),
      dequeueRollouts: (req) => store.raw.dequeueRollouts(req),
      heartbeatAttempt: (req) => store.raw.heartbeatAttempt(req),
      completeAttempt: (req) => store.raw.completeAttempt(req),
    }));
  });
  after(() => older.close());

  test("is asked with the unary calls instead", async () => {
    const client = new StoreClient(older.address);
    const session = client.runnerSession();
    try {
      await client.enqueueRollouts([{ input: 1 }, { input: 2 }]);
      const got = await session.dequeueRollout({ workerId: "ts-older" });
      assert.ok(got?.latestAttempt);
      const [, rollout, next] = await session.completeAndDequeue(got.rolloutId, got.latestAttempt.attemptId, AttemptStatus.SUCCEEDED, {
        workerId: "ts-older",
      });
      assert.equal(rollout.status, RolloutStatus.SUCCEEDED);
      assert.equal(next.length, 1);
    } finally {
      await session.close();
    }
  });
});

describe("a stream that stays open and answers nothing", () => {
  let relay: Front;
  let opened = 0;
  before(async () => {
    // The first RunnerSession stream reads every message and answers none; every later one is the real
    // server's.
    relay = await serveInFront((store) => ({
      async *runnerSession(requests) {
        opened += 1;
        if (opened === 1) {
          for await (const _ of requests);
          return;
        }
        yield* store.raw.runnerSession(requests);
      },
    }));
  });
  after(() => relay.close());

  test("is given up: the call that waited fails, and a claim still owed is answered on a new stream", async () => {
    const store = new StoreClient(relay.server.address);
    const session = new StoreClient({ target: relay.address, timeout: 0.5 }).runnerSession();
    try {
      const claim = session.dequeueRollout({ workerId: "ts-silent", wait: 10 });
      await new Promise((r) => setTimeout(r, 100));
      await assert.rejects(session.heartbeatAttempt("ro-x", "at-x"), (error: unknown) => error instanceof DeadlineExceededError);
      const [queued] = await store.enqueueRollouts([{ input: "after" }]);
      const got = await claim;
      assert.equal(got?.rolloutId, queued?.rolloutId);
      assert.equal(opened, 2);
      await assert.rejects(session.heartbeatAttempt("ro-x", "at-x"), (error: unknown) => error instanceof NotFoundError);
      assert.equal(opened, 2);
    } finally {
      await session.close();
    }
  });
});
