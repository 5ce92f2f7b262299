/**
 * A client given a store's writer and its standby (`target: "writer,standby"`) against real servers on
 * PostgreSQL: the writer is killed, the standby takes the writer lease, and the same client goes on.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { AttemptStatus, FailoverTransport, RolloutStatus, SpanStream, StoreClient, makeSpan, rolloutTraceId, targetAddresses } from "../src/index.js";
import { CLI, freePort, start, startPostgres, startServer } from "./helpers.js";

describe("a store with a standby", () => {
  test("a target of several addresses is read as the Python client reads it", () => {
    assert.deepEqual(targetAddresses("10.0.0.1:4747, 10.0.0.2:4747"), ["10.0.0.1:4747", "10.0.0.2:4747"]);
    assert.deepEqual(targetAddresses("127.0.0.1:4747"), ["127.0.0.1:4747"]);
    assert.throws(() => targetAddresses(" , "), /names no address/);
  });

  test("a client given the writer's and the standby's addresses carries on across a take-over", async (t) => {
    const pg = await startPostgres();
    if ("reason" in pg) {
      t.skip(`no PostgreSQL here: ${pg.reason}`);
      return;
    }
    const writer = await startServer(["--postgres", pg.url]);
    const standbyPort = await freePort();
    const standby = start("standby", CLI, ["serve", "--port", String(standbyPort), "--grace", "1", "--no-dashboard", "--postgres", pg.url]);
    try {
      await standby.waitFor("event=postgres_standby");
      const target = `${writer.address},127.0.0.1:${standbyPort}`;
      const client = new StoreClient({ target, timeout: 10 });
      assert.equal(client.config.target, target);
      const running = await client.startRollout("before the take-over", { workerId: "ts-failover" });
      const attemptId = running.latestAttempt!.attemptId;
      const stream = new SpanStream(client);
      const span = (name: string) => makeSpan({ name, rolloutId: running.rolloutId, attemptId, traceId: rolloutTraceId(running.rolloutId) });
      stream.submit(span("before"));
      assert.equal(await stream.flush(undefined, undefined, 10), true);

      writer.child.proc.kill("SIGKILL");
      stream.submit(span("across"));
      await standby.waitFor("event=server_started");
      // the same client, not told anything: reads, writes and the span stream go to the standby
      const kept = await client.getRollout(running.rolloutId);
      assert.equal(kept.rolloutId, running.rolloutId);
      assert.ok([RolloutStatus.PREPARING, RolloutStatus.RUNNING].includes(kept.status), `status ${kept.status}`);
      const [queued] = await client.enqueueRollouts([{ input: "after the take-over" }]);
      assert.ok(queued);
      stream.submit(span("after"));
      assert.equal(await stream.flush(undefined, undefined, 30), true);
      await stream.close();
      const names = (await client.querySpans(running.rolloutId)).map((s) => s.name).sort();
      assert.deepEqual(names, ["across", "after", "before"]);
      assert.ok(stream.stats.reconnects >= 1 && stream.stats.givenUp === 0, JSON.stringify(stream.stats));
      const [, done] = await client.completeAttempt(running.rolloutId, attemptId, AttemptStatus.SUCCEEDED);
      assert.equal(done.status, RolloutStatus.SUCCEEDED);
    } finally {
      await standby.stop();
      await writer.stop();
      await pg.child.stop();
    }
  });

  test("calls go on to the next address at once when nobody listens at the first", async () => {
    const server = await startServer();
    try {
      const nobody = await freePort();
      const client = new StoreClient({ target: `127.0.0.1:${nobody},${server.address}`, retry: null, timeout: 5 });
      assert.ok(client.transport instanceof FailoverTransport);
      const started = Date.now();
      const stats = await client.raw.getStatistics({});
      assert.equal(typeof stats.totalRollouts, "bigint");
      assert.equal((client.transport as FailoverTransport).address, server.address);
      assert.ok(Date.now() - started < 3000, "no back-off: a refused connection moves on at once");
    } finally {
      await server.stop();
    }
  });
});
