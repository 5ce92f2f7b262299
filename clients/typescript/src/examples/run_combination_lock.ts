#!/usr/bin/env node
/**
 * A TypeScript runner playing the combination-lock agent:
 *
 *   node dist/src/examples/run_combination_lock.js --store 127.0.0.1:4747 --concurrency 64
 *
 * Options fall back on the environment a training run gives an agent command: LIGHTNING_GRPC_STORE,
 * LIGHTNING_GRPC_TOKEN (admin token or a runner credential), LIGHTNING_GRPC_CONCURRENCY,
 * LIGHTNING_GRPC_WORKER_ID. OTLP export of the agent's spans is configured by the OTEL_* variables alone.
 * SIGTERM or SIGINT stops taking rollouts and drains the running ones.
 */
import { parseArgs } from "node:util";
import { installOtlpTracing } from "../otel.js";
import { Runner } from "../runner.js";
import { agent } from "./combination_lock.js";

const { values } = parseArgs({
  options: {
    store: { type: "string", default: process.env.LIGHTNING_GRPC_STORE ?? "127.0.0.1:4747" },
    token: { type: "string", default: process.env.LIGHTNING_GRPC_TOKEN ?? "" },
    concurrency: { type: "string", default: process.env.LIGHTNING_GRPC_CONCURRENCY ?? "8" },
    "worker-id": { type: "string", default: process.env.LIGHTNING_GRPC_WORKER_ID ?? "" },
    "poll-wait": { type: "string", default: "1" },
    "max-rollouts": { type: "string" },
  },
});

const shutdownTracing = installOtlpTracing("combination-lock-agent");
const runner = new Runner(agent, values.store!, {
  token: values.token || undefined,
  concurrency: Number(values.concurrency),
  workerId: values["worker-id"] || undefined,
  pollWait: Number(values["poll-wait"]),
  maxRollouts: values["max-rollouts"] ? Number(values["max-rollouts"]) : undefined,
});
for (const signal of ["SIGTERM", "SIGINT"] as const) process.on(signal, () => runner.stop());
try {
  await runner.run();
} finally {
  await shutdownTracing?.();
}
