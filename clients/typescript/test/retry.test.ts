/**
 * The retry policy: the client resends only the calls the contract marks NO_SIDE_EFFECTS or IDEMPOTENT
 * (the generated RETRYABLE_METHODS), as the Python client does from the same marks.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { Code, ConnectError, createClient, createRouterTransport } from "@connectrpc/connect";
import { MethodOptions_IdempotencyLevel } from "@bufbuild/protobuf/wkt";
import {
  isRetryable,
  ProxyService,
  RETRYABLE_METHODS,
  retrying,
  StoreService,
  TrainerService,
  UnavailableError,
} from "../src/index.js";

const SERVICES = [StoreService, TrainerService, ProxyService];

describe("retry policy", () => {
  test("StartAttempt is not retried; reads and idempotent writes are", () => {
    assert.ok(!RETRYABLE_METHODS.has("lightning.v1.StoreService/StartAttempt"));
    assert.ok(!isRetryable(StoreService.method.startAttempt));
    assert.ok(!isRetryable(StoreService.method.retryRollout));
    assert.ok(RETRYABLE_METHODS.has("lightning.v1.StoreService/GetRollout"));
    assert.ok(isRetryable(StoreService.method.getRollout));
    assert.ok(isRetryable(StoreService.method.dequeueRollouts));
    assert.ok(isRetryable(TrainerService.method.getTrainerStatus));
  });

  test("the list is exactly the methods whose descriptors carry an idempotency level", () => {
    const marked = new Set<string>();
    for (const service of SERVICES) {
      for (const method of service.methods) {
        if (method.idempotency !== MethodOptions_IdempotencyLevel.IDEMPOTENCY_UNKNOWN) {
          marked.add(`${service.typeName}/${method.name}`);
        }
      }
    }
    assert.deepEqual([...RETRYABLE_METHODS].sort(), [...marked].sort());
  });

  test("UNAVAILABLE is retried for a read, never for StartAttempt", async () => {
    const calls = { getRollout: 0, startAttempt: 0 };
    const transport = createRouterTransport(
      (router) => {
        router.service(StoreService, {
          getRollout() {
            calls.getRollout += 1;
            if (calls.getRollout === 1) throw new ConnectError("not yet", Code.Unavailable);
            return { rollout: { rolloutId: "ro-1" } };
          },
          startAttempt() {
            calls.startAttempt += 1;
            throw new ConnectError("not yet", Code.Unavailable);
          },
        });
      },
      {
        transport: {
          interceptors: [retrying({ maxAttempts: 5, initialBackoffMs: 1, maxBackoffMs: 5, backoffMultiplier: 2 })],
        },
      },
    );
    const client = createClient(StoreService, transport);
    const res = await client.getRollout({ rolloutId: "ro-1" });
    assert.equal(res.rollout?.rolloutId, "ro-1");
    assert.equal(calls.getRollout, 2);
    await assert.rejects(client.startAttempt({ rolloutId: "ro-1" }), (error: unknown) => {
      assert.equal(ConnectError.from(error).code, Code.Unavailable);
      return true;
    });
    assert.equal(calls.startAttempt, 1);
    assert.ok(UnavailableError.retryable);
  });
});
