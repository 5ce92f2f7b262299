/**
 * The Trainer and Proxy clients against a real server (`serve --proxy`, which hosts the TrainerService and
 * the ProxyService on the Store's port): groups submitted and played, steps reported and watched, the
 * proxy's backends, pause, resume, drain and status.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { AttemptStatus, NotFoundError, ProxyClient, RolloutMode, StoreClient, TrainerClient } from "../src/index.js";
import { startServer, type Server } from "./helpers.js";

describe("the Trainer and Proxy clients", () => {
  let server: Server;
  let trainer: TrainerClient;
  let proxy: ProxyClient;
  let store: StoreClient;
  before(async () => {
    server = await startServer(["--proxy", "--proxy-port", "0"]);
    trainer = new TrainerClient({ target: server.address, timeout: 10 });
    proxy = new ProxyClient(server.address);
    store = new StoreClient(server.address);
  });
  after(async () => {
    await server.stop();
  });

  test("submitGroups makes groupSize rollouts per sample, and a resend with the same group ids makes none", async () => {
    const groups = await trainer.submitGroups([{ q: "2+2" }, { input: "3+3", groupId: "g-ts-fixed" }], 3, { mode: RolloutMode.TRAIN });
    assert.equal(groups.length, 2);
    assert.ok(groups.every((g) => g.rolloutIds.length === 3));
    assert.equal(groups[1]?.groupId, "g-ts-fixed");
    const again = await trainer.submitGroups([{ input: "3+3", groupId: "g-ts-fixed" }], 3);
    assert.deepEqual(again[0]?.rolloutIds, groups[1]?.rolloutIds);
    const status = await trainer.status();
    const train = status.groups.find((g) => g.mode === RolloutMode.TRAIN);
    assert.ok(train && train.pending + train.ready >= 2, "the groups are pending");

    // played without LLM calls: every rollout has nothing to train on, which the triplets report says
    const claimed = await store.dequeueRollouts(6, { workerId: "ts-trainer", wait: 1 });
    assert.equal(claimed.length, 6);
    for (const rollout of claimed) await store.completeAttempt(rollout.rolloutId, rollout.latestAttempt!.attemptId, AttemptStatus.SUCCEEDED);
    const report = await trainer.triplets(claimed[0]!.rolloutId);
    assert.equal(report.rolloutId, claimed[0]!.rolloutId);
    assert.equal(report.triplets.length, 0);
    await assert.rejects(trainer.triplets("ro-no-such"), NotFoundError);
  });

  test("reportStep and watchTraining: reported steps come back in order", async () => {
    const first = await trainer.reportStep(1, 1, { loss: 0.5 }, { runId: "ts-run" });
    const second = await trainer.reportStep(2, 2, { loss: 0.25 }, { runId: "ts-run" });
    assert.ok(second.sequence > first.sequence);
    const seen = [];
    for await (const event of trainer.watchTraining("ts-run")) seen.push(event);
    assert.deepEqual(seen.map((e) => [e.step, e.policyVersion, e.metrics["loss"]]), [[1n, 1n, 0.5], [2n, 2n, 0.25]]);
    assert.equal((await trainer.status()).policyVersion, 2n);
  });

  test("reportStep carries the run's interruptions; they come back through watchTraining", async () => {
    const interruptions = [
      { time: 1_700_000_000.5, process: "engine", cause: "exited with signal 9 (SIGKILL)", recovery: "restarted on the same port after 1.0 s back-off", recoverySeconds: 2.5, step: 3 },
      { time: new Date(1_700_000_010_000), process: "trainer", recovery: "resumed from checkpoint step-000002", step: 3n },
    ];
    const event = await trainer.reportStep(3, 3, { loss: 0.1 }, { runId: "ts-interrupted", interruptions });
    assert.deepEqual(
      event.interruptions.map((i) => [i.process, i.cause, i.recoverySeconds, i.step, Number(i.time?.seconds)]),
      [["engine", "exited with signal 9 (SIGKILL)", 2.5, 3n, 1_700_000_000], ["trainer", "", 0, 3n, 1_700_000_010]],
    );
    const again = await trainer.reportStep(3, 3, { loss: 0.1 }, { runId: "ts-interrupted", interruptions });
    assert.equal(again.sequence, event.sequence, "a resend with the same interruptions is the stored event");
    const seen = [];
    for await (const e of trainer.watchTraining("ts-interrupted")) seen.push(e);
    assert.deepEqual(seen.map((e) => e.interruptions.map((i) => i.recovery)), [["restarted on the same port after 1.0 s back-off", "resumed from checkpoint step-000002"]]);
  });

  test("the proxy: backends set and listed, pause, resume, drain and status", async () => {
    const set = await proxy.setBackends([{ modelName: "policy", apiBase: "http://127.0.0.1:9/v1", apiKey: "k" }]);
    assert.deepEqual(set.map((b) => b.modelName), ["policy"]);
    assert.deepEqual((await proxy.listBackends()).map((b) => [b.modelName, b.apiBase]), [["policy", "http://127.0.0.1:9/v1"]]);
    assert.equal(await proxy.pause("weights update", 2), 0);
    assert.equal((await proxy.status()).paused, true);
    await proxy.resume();
    const status = await proxy.status();
    assert.equal(status.paused, false);
    assert.equal(status.httpAddress !== "", true);
    assert.equal(await proxy.drain(1), 0);

    const running = await store.startRollout("routed", { workerId: "ts-proxy" });
    const endpoint = await proxy.attemptEndpoint(running.rolloutId, running.latestAttempt!.attemptId, "policy");
    assert.ok(endpoint.endpoint.includes(`/rollout/${running.rolloutId}/attempt/${running.latestAttempt!.attemptId}`), endpoint.endpoint);
    assert.equal(endpoint.model, "policy");
  });
});
