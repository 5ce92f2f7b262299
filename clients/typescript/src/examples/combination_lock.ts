/**
 * The training demo's toy agent, in TypeScript: the combination lock of
 * `lightning_grpc/examples/combination_lock.py`, played through the proxy with the official `openai` client.
 *
 * A lock with a code the agent is never told (every lock: 3 then 7). The lock asks for one digit per turn
 * and answers "Click." (right) or "Wrong."; the reward is the fraction of the code unlocked. With
 * `moves_on` a wrong digit moves the lock on too (always one call per digit), as in the demo.
 *
 * Each press is also an OpenTelemetry span (`lock.press`, with the digit and whether it was right) sent by
 * the stock OTLP/gRPC exporter when the `OTEL_*` variables configure one; the runner sends the attempt's
 * root and reward spans over the Store's span stream.
 */
import type { JsonObject, JsonValue } from "@bufbuild/protobuf";
import { trace } from "@opentelemetry/api";
import OpenAI from "openai";
import { createHash } from "node:crypto";
import type { AgentResources, AttemptContext } from "../runner.js";
import { attemptContext } from "../otel.js";
import { semconv } from "../semconv.js";

const ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth"];
export const CLICK = "Click.";
export const WRONG = "Wrong.";
const MAX_PRESSES = 3;
const DEFAULT_SAMPLING = { temperature: 1.0, top_p: 1.0, max_tokens: 4 };

export interface LockTask {
  task_id?: string;
  prompt: string;
  code: string;
  preset?: number;
  max_presses?: number;
  moves_on?: boolean;
  sampling?: Partial<typeof DEFAULT_SAMPLING>;
}

export type Message = { role: "user" | "assistant"; content: string };

export function ask(position: number): string {
  return `Enter the ${ORDINALS[position] ?? `number ${position + 1}`} digit.`;
}

/** The digit a reply presses: its first digit character (none: a wrong press). */
export function parseDigit(text: string | null | undefined): string | undefined {
  return /[0-9]/.exec(text ?? "")?.[0];
}

/** The lock's side of one game: the conversation, the presses and the reward. */
export class Episode {
  readonly messages: Message[];
  presses = 0;
  unlocked: number;
  position: number;

  constructor(readonly task: LockTask) {
    if (!/^[0-9]+$/.test(task.code ?? "")) throw new TypeError(`a lock task needs a code of digits, got ${JSON.stringify(task.code)}`);
    this.unlocked = task.preset ?? 0;
    this.position = this.unlocked;
    this.messages = [{ role: "user", content: String(task.prompt) }];
  }

  get maxPresses(): number {
    return this.task.max_presses ?? MAX_PRESSES;
  }
  get opened(): boolean {
    return this.unlocked >= this.task.code.length;
  }
  get done(): boolean {
    return this.opened || this.presses >= this.maxPresses || this.position >= this.task.code.length;
  }
  get reward(): number {
    return this.task.code.length ? this.unlocked / this.task.code.length : 0;
  }

  /** The agent's reply; returns whether the press was right. */
  answer(text: string): boolean {
    if (this.done) throw new Error("the episode is over");
    const digit = parseDigit(text);
    const right = digit !== undefined && digit === this.task.code[this.position];
    this.presses++;
    this.messages.push({ role: "assistant", content: text });
    if (right) this.unlocked++;
    if (right || this.task.moves_on) this.position++;
    if (!this.done) this.messages.push({ role: "user", content: `${right ? CLICK : WRONG} ${ask(this.position)}` });
    return right;
  }
}

/** A sampling seed for one call of a rollout: the same rollout replays the same tokens. */
export function callSeed(rolloutId: string, callIndex: number): number {
  const digest = createHash("sha256").update(`${rolloutId}:${callIndex}`).digest();
  return digest.readUInt32BE(0) * 2 ** 21 + (digest.readUInt32BE(4) >>> 11); // under 2**53
}

function sampling(task: LockTask, defaults: JsonObject): typeof DEFAULT_SAMPLING {
  const out = { ...DEFAULT_SAMPLING };
  for (const source of [defaults, task.sampling ?? {}] as Record<string, unknown>[]) {
    for (const key of Object.keys(DEFAULT_SAMPLING) as (keyof typeof DEFAULT_SAMPLING)[]) {
      if (typeof source[key] === "number") out[key] = source[key] as number;
    }
  }
  return out;
}

const tracer = trace.getTracer("lightning-grpc.examples.combination_lock");

/** Play one lock through the attempt's LLM endpoint; returns the reward (the fraction unlocked). */
export async function agent(input: JsonValue, resources: AgentResources, ctx: AttemptContext): Promise<number> {
  const llm = resources.llm;
  if (!llm) throw new Error("the rollout's resources hold no LLM endpoint");
  const task = input as unknown as LockTask;
  const params = sampling(task, llm.samplingParameters);
  const client = new OpenAI({ baseURL: llm.endpoint, apiKey: llm.apiKey || "unused", maxRetries: 2 });
  const episode = new Episode(task);
  const parent = attemptContext(ctx.traceId, ctx.rootSpanId);
  while (!episode.done) {
    const span = tracer.startSpan("lock.press", { attributes: { [semconv.ROLLOUT_ID]: ctx.rolloutId, [semconv.ATTEMPT_ID]: ctx.attemptId, "lock.position": episode.position } }, parent);
    try {
      const response = await client.chat.completions.create(
        {
          model: llm.model,
          messages: episode.messages,
          temperature: params.temperature,
          top_p: params.top_p,
          max_tokens: params.max_tokens,
          seed: callSeed(ctx.rolloutId, episode.presses),
        },
        { signal: ctx.signal },
      );
      const text = response.choices[0]?.message.content ?? "";
      const right = episode.answer(text);
      span.setAttributes({ "lock.reply": text, "lock.right": right });
    } finally {
      span.end();
    }
  }
  return episode.reward;
}
