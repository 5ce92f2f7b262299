/**
 * The TypeScript runner against real services: outcomes, root and reward spans; then the combination-lock
 * agent with the official `openai` client on its per-attempt proxy route, under a runner credential, its
 * spans sent both over the span stream and by the stock OTLP/gRPC exporter configured by OTEL_* alone.
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import { test } from "node:test";
import {
  AttemptStatus,
  Runner,
  RolloutStatus,
  StoreClient,
  rolloutTraceId,
  semconv,
  type AnyValue,
  type Span,
} from "../src/index.js";
import { PACKAGE, QUIET, cli, eventually, start, startEngine, startServer, tinyModel } from "./helpers.js";

function attr(span: Span, key: string): AnyValue["value"]["value"] | undefined {
  return span.attributes[key]?.value.value;
}

test("the runner plays rollouts, records root and reward spans, and keeps an agent's error", async () => {
  const server = await startServer();
  try {
    const client = new StoreClient(server.address);
    const good = await client.enqueueRollout({ score: 0.75 });
    const named = await client.enqueueRollout({ named: true });
    const bad = await client.enqueueRollout({ fail: "the tool broke" });
    const runner = new Runner(
      async (input, _resources, ctx) => {
        const task = input as { score?: number; named?: boolean; fail?: string };
        ctx.emitSpan("tool.call", { tool: "search" });
        if (task.fail) throw new Error(task.fail);
        // several named dimensions: the first is the one training uses
        return task.named ? { accuracy: 1, brevity: 0.5 } : task.score;
      },
      server.address,
      { concurrency: 2, maxRollouts: 3, pollWait: 0.5, workerId: "ts-runner-1" },
    );
    assert.equal(await runner.run(), 3);
    assert.deepEqual([runner.succeeded, runner.failed], [2, 1]);

    for (const rollout of [good, named]) {
      const final = await client.getRollout(rollout.rolloutId);
      assert.equal(final.status, RolloutStatus.SUCCEEDED);
      assert.equal(final.latestAttempt?.workerId, "ts-runner-1");
    }
    const spans = await client.querySpans(good.rolloutId);
    const root = spans.find((s) => s.name === semconv.SPAN_ROLLOUT);
    const reward = spans.find((s) => s.name === semconv.SPAN_REWARD);
    const tool = spans.find((s) => s.name === "tool.call");
    assert.ok(root && reward && tool, spans.map((s) => s.name).join());
    assert.equal(root.traceId, rolloutTraceId(good.rolloutId));
    assert.equal(root.parentSpanId, "");
    assert.equal(attr(root, semconv.ROLLOUT_ID), good.rolloutId);
    for (const child of [reward, tool]) {
      assert.equal(child.parentSpanId, root.spanId);
      assert.equal(child.traceId, root.traceId);
    }
    assert.equal(attr(reward, `${semconv.REWARD_VALUE}.primary`), 0.75);
    assert.equal(attr(reward, semconv.REWARD_PRIMARY), "primary");
    const namedReward = (await client.querySpans(named.rolloutId)).find((s) => s.name === semconv.SPAN_REWARD)!;
    assert.equal(attr(namedReward, `${semconv.REWARD_VALUE}.brevity`), 0.5);
    assert.equal(attr(namedReward, semconv.REWARD_PRIMARY), "accuracy");

    const failed = await client.getRollout(bad.rolloutId);
    assert.equal(failed.status, RolloutStatus.FAILED);
    assert.equal(failed.latestAttempt?.status, AttemptStatus.FAILED);
    const error = (failed.latestAttempt?.metadata ?? {}) as { error?: { type: string; message: string; traceback: string } };
    assert.equal(error.error?.type, "Error");
    assert.equal(error.error?.message, "the tool broke");
    assert.match(error.error?.traceback ?? "", /runner\.test/);
  } finally {
    await server.stop();
  }
});

test("a heartbeat that says stop aborts the agent through ctx.signal, and the runner counts it stopped", async () => {
  const server = await startServer();
  try {
    const client = new StoreClient(server.address);
    const queued = await client.enqueueRollout({ wait: true });
    let sawAbort = false;
    const runner = new Runner(
      async (_input, _resources, ctx) => {
        await new Promise<void>((resolve) => ctx.signal.addEventListener("abort", () => resolve(), { once: true }));
        sawAbort = true;
        return 1;
      },
      server.address,
      { maxRollouts: 1, pollWait: 0.3, heartbeatInterval: 0.2 },
    );
    const running = runner.run();
    await eventually("the rollout to run", async () =>
      (await client.getRollout(queued.rolloutId)).status === RolloutStatus.RUNNING ? true : undefined,
    );
    await client.cancelRollout(queued.rolloutId, "the test cancels it");
    assert.equal(await running, 1);
    assert.equal(sawAbort, true);
    assert.deepEqual([runner.stopped, runner.succeeded, runner.failed], [1, 0, 0]);
    const final = await client.getRollout(queued.rolloutId);
    assert.equal(final.status, RolloutStatus.CANCELLED);
    const names = (await client.querySpans(queued.rolloutId)).map((s) => s.name);
    assert.ok(!names.includes(semconv.SPAN_REWARD), "a stopped attempt records no reward");
  } finally {
    await server.stop();
  }
});

test("the combination-lock agent calls the model through the proxy and exports spans over OTLP", { timeout: 300_000 }, async () => {
  const token = "ts-admin-token-for-the-agent-test";
  const engine = await startEngine(tinyModel());
  const server = await startServer(["--token", token, "--proxy-backend", `${engine.url}/v1`, "--proxy-model-name", "policy", "--proxy-port", "0"]);
  const workerId = "ts-lock-worker";
  const credential = cli(["credential", "runner", "--worker-id", workerId, "--token", token]).trim();
  const runnerProcess = start("ts-runner", process.execPath, [join(PACKAGE, "dist", "src", "examples", "run_combination_lock.js"), "--max-rollouts", "4", "--poll-wait", "0.5"], {
    ...QUIET,
    LIGHTNING_GRPC_STORE: server.address,
    LIGHTNING_GRPC_TOKEN: credential,
    LIGHTNING_GRPC_WORKER_ID: workerId,
    LIGHTNING_GRPC_CONCURRENCY: "4",
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: `http://${server.address}`,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "grpc",
    OTEL_EXPORTER_OTLP_HEADERS: `authorization=Bearer%20${credential}`,
    OTEL_BSP_SCHEDULE_DELAY: "200",
    OTEL_SERVICE_NAME: "ts-lock-agent",
  });
  try {
    await runnerProcess.waitFor("event=runner_started");
    const admin = new StoreClient({ target: server.address, token });
    await admin.raw.addResources({
      resourcesId: "rs-ts-lock",
      resources: {
        llm: { kind: { case: "proxyLlm", value: { endpoint: `${server.proxyUrl}/v1`, model: "policy", samplingParameters: { temperature: 1.0, max_tokens: 2 } } } },
      },
    });
    const tasks = [0, 1, 2, 3].map((i) => ({
      task_id: `ts-${i}`,
      prompt: `The door ${i} has a two-digit combination lock. Enter the first digit.`,
      code: "37",
      max_presses: 2,
      moves_on: true,
    }));
    const rollouts = await admin.enqueueRollouts(tasks.map((input) => ({ input, resourcesId: "rs-ts-lock" })));
    await runnerProcess.waitFor("event=runner_stopped", 120_000);
    await runnerProcess.stop();
    assert.equal(runnerProcess.proc.exitCode, 0, runnerProcess.tail());

    for (const rollout of rollouts) {
      const final = await admin.getRollout(rollout.rolloutId);
      assert.equal(final.status, RolloutStatus.SUCCEEDED, runnerProcess.tail());
      assert.equal(final.latestAttempt?.workerId, workerId);
      const spans = await admin.querySpans(rollout.rolloutId);
      const names = spans.map((s) => s.name);
      const root = spans.find((s) => s.name === semconv.SPAN_ROLLOUT)!;
      const calls = spans.filter((s) => s.name === "lightning.llm.call");
      const presses = spans.filter((s) => s.name === "lock.press");
      assert.ok(root, names.join());
      assert.equal(calls.length, 2, `two LLM calls recorded by the proxy: ${names.join()}`);
      assert.equal(presses.length, 2, `two presses exported over OTLP: ${names.join()}`);
      assert.ok(names.includes(semconv.SPAN_REWARD));
      for (const press of presses) {
        assert.equal(press.traceId, rolloutTraceId(rollout.rolloutId));
        assert.equal(press.parentSpanId, root.spanId);
        assert.equal(press.resource["service.name"]?.value.value, "ts-lock-agent");
        assert.equal(typeof attr(press, "lock.right"), "boolean");
      }
      for (const call of calls) {
        assert.ok(Object.keys(call.attributes).some((k) => k.includes("token_ids")), Object.keys(call.attributes).join());
      }
    }
  } finally {
    await runnerProcess.stop();
    await server.stop();
    await engine.child.stop();
  }
});
