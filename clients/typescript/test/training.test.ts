/**
 * The Python training loop trains the model that the TypeScript agent plays: `lightning-grpc train` with
 * `agent.command` starting the TypeScript runner (no Python agent in the run), GRPO on the tiny model,
 * and the agent's reward rises.
 */
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { CLI, QUIET, ROOT, tempDir } from "./helpers.js";

function metrics(path: string): Record<string, number>[] {
  const [head, ...rows] = readFileSync(path, "utf8").trim().split("\n");
  const keys = (head ?? "").split(",");
  return rows.map((row) => Object.fromEntries(row.split(",").map((v, i) => [keys[i] as string, Number(v)])));
}

const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;

test("a short training run improves the TypeScript agent's reward", { timeout: 600_000 }, async () => {
  const dir = tempDir("lgrpc-ts-train-");
  // The Python example's locks (half of them half open), written by the example's own code.
  const python = join(ROOT, ".venv", "bin", "python");
  const wrote = spawnSync(
    python,
    [
      "-c",
      "import sys; from lightning_grpc.examples.combination_lock import train_tasks, val_tasks, write_jsonl; " +
        "write_jsonl(train_tasks(), sys.argv[1]); write_jsonl(val_tasks()[:4], sys.argv[2])",
      join(dir, "train.jsonl"),
      join(dir, "val.jsonl"),
    ],
    { encoding: "utf8" },
  );
  assert.equal(wrote.status, 0, wrote.stderr);
  const set = (key: string, value: unknown) => ["--set", `${key}=${JSON.stringify(value)}`];
  const args = [
    "train",
    join(ROOT, "examples", "combination_lock", "typescript.toml"),
    ...set("experiment.steps", 30),
    ...set("experiment.mode", "sync"),
    // sync runs are reproducible: this seed's first steps already have a reward spread (seed 0's learn slower)
    ...set("experiment.seed", 1),
    ...set("experiment.output_dir", join(dir, "out")),
    ...set("agent.train_tasks", join(dir, "train.jsonl")),
    ...set("agent.val_tasks", join(dir, "val.jsonl")),
    ...set("model.path", join(dir, "model")),
    ...set("optim.lr", 5e-3),
    ...set("ppo.loss_agg_mode", "per-rollout-mean"),
    ...set("validation.every", 10),
    ...set("validation.samples", 2),
    "--no-progress",
  ];
  const output: string[] = [];
  const code = await new Promise<number | null>((resolve) => {
    const child = spawn(CLI, args, { cwd: ROOT, env: QUIET, stdio: ["ignore", "pipe", "pipe"] });
    child.stdout.on("data", (chunk: Buffer) => output.push(chunk.toString()));
    child.stderr.on("data", (chunk: Buffer) => output.push(chunk.toString()));
    child.on("exit", resolve);
  });
  const text = output.join("");
  assert.equal(code, 0, text.slice(-4000));
  const history = metrics(join(dir, "out", "metrics.csv"));
  assert.deepEqual(
    history.map((r) => r["policy_version"]),
    Array.from({ length: 30 }, (_, i) => i + 1),
    "each step served a new policy",
  );
  assert.ok(history.every((r) => r["rollouts"] === 128), "every rollout of every group was played and trained");
  const first = mean(history.slice(0, 3).map((r) => r["reward_mean"] as number));
  const last = mean(history.slice(-5).map((r) => r["reward_mean"] as number));
  assert.ok(last >= first + 0.2, `reward ${first.toFixed(3)} -> ${last.toFixed(3)}`);
  assert.match(text, /validation reward: before [0-9.]+, after [0-9.]+/);
  process.stdout.write(`# TypeScript agent, reward_mean first 3 steps ${first.toFixed(3)} -> last 5 steps ${last.toFixed(3)}\n`);
});
