/**
 * The contract's semantic conventions in TypeScript (the Python side's one module is lightning_grpc/semconv.py):
 * span and attribute names, attribute values to and from the contract's AnyValue, and rewards written and
 * read. Nothing here needs Node, so the dashboard uses this same module in the browser.
 */
import { create } from "@bufbuild/protobuf";
import { AnyValueSchema, type AnyValue } from "./gen/lightning/v1/common_pb.js";

/** Attribute and span names. */
export const semconv = Object.freeze({
  ROLLOUT_ID: "lightning.rollout_id",
  ATTEMPT_ID: "lightning.attempt_id",
  ATTEMPT_SEQUENCE_NUMBER: "lightning.attempt.sequence_number",
  SPAN_ROLLOUT: "lightning.rollout",
  SPAN_REWARD: "lightning.reward",
  SPAN_OPERATION: "lightning.operation",
  SPAN_MESSAGE: "lightning.message",
  /** The span the proxy writes for each LLM call. */
  SPAN_LLM_CALL: "lightning.llm.call",
  MESSAGE_BODY: "lightning.message.body",
  REWARD_VALUE: "lightning.reward.value",
  REWARD_PRIMARY: "lightning.reward.primary",
  PRIMARY: "primary",
  /** The attributes the proxy writes on SPAN_LLM_CALL all start so. */
  LLM_PREFIX: "lightning.llm.",
  LLM_PROMPT_TOKEN_IDS: "lightning.llm.prompt_token_ids",
  LLM_RESPONSE_TOKEN_IDS: "lightning.llm.response_token_ids",
  LLM_RESPONSE_LOGPROBS: "lightning.llm.response_logprobs",
  /** Response positions a grammar forced (the only token allowed): not the policy's choice, not trained. */
  LLM_RESPONSE_FORCED_POSITIONS: "lightning.llm.response_forced_positions",
  LLM_MODEL: "lightning.llm.model",
  LLM_POLICY_VERSION: "lightning.llm.policy_version",
  LLM_REQUEST: "lightning.llm.request",
  LLM_RESPONSE: "lightning.llm.response",
  LLM_FINISH_REASON: "lightning.llm.finish_reason",
  LLM_LATENCY_MS: "lightning.llm.latency_ms",
  LLM_USAGE_PROMPT_TOKENS: "gen_ai.usage.input_tokens",
  LLM_USAGE_COMPLETION_TOKENS: "gen_ai.usage.output_tokens",
  LLM_ERROR: "lightning.llm.error",
  /** The API the agent spoke to the proxy: chat_completions, completions, responses, anthropic_messages. */
  LLM_DIALECT: "lightning.llm.dialect",
  /** JSON of the request as the agent sent it, when its dialect was translated to chat completions. */
  LLM_DIALECT_REQUEST: "lightning.llm.dialect_request",
});

export type AttributeValue = string | number | boolean | bigint | readonly string[] | readonly number[];

/** One attribute value in the contract's AnyValue (integers that are whole numbers stay doubles). */
export function anyValue(value: AttributeValue): AnyValue {
  if (typeof value === "string") return create(AnyValueSchema, { value: { case: "stringValue", value } });
  if (typeof value === "boolean") return create(AnyValueSchema, { value: { case: "boolValue", value } });
  if (typeof value === "bigint") return create(AnyValueSchema, { value: { case: "intValue", value } });
  if (typeof value === "number") return create(AnyValueSchema, { value: { case: "doubleValue", value } });
  if (value.every((v) => typeof v === "number")) {
    return create(AnyValueSchema, { value: { case: "doubleArrayValue", value: { values: value as number[] } } });
  }
  return create(AnyValueSchema, {
    value: { case: "arrayValue", value: { values: (value as readonly string[]).map((v) => anyValue(String(v))) } },
  });
}

export function attributes(values: Record<string, AttributeValue>): Record<string, AnyValue> {
  return Object.fromEntries(Object.entries(values).map(([k, v]) => [k, anyValue(v)]));
}

/** An AnyValue as plain JavaScript (64-bit integers as numbers, key/value lists as objects). */
export function plainValue(value: AnyValue | undefined): unknown {
  const v = value?.value;
  if (!v || v.case === undefined) return undefined;
  switch (v.case) {
    case "intValue":
      return Number(v.value);
    case "arrayValue":
      return v.value.values.map(plainValue);
    case "kvlistValue":
      return Object.fromEntries(v.value.values.map((kv) => [kv.key, plainValue(kv.value)]));
    case "intArrayValue":
      return v.value.values.map(Number);
    case "doubleArrayValue":
      return v.value.values;
    case "bytesValue":
      return `${v.value.length} bytes`;
    default:
      return v.value;
  }
}

/** The attributes of a reward: one double per named dimension and the name of the primary one. */
export function rewardAttributes(reward: number | Record<string, number>, primary?: string): Record<string, AttributeValue> {
  const dims = typeof reward === "number" ? { [semconv.PRIMARY]: reward } : reward;
  const names = Object.keys(dims);
  if (names.length === 0) throw new RangeError("a reward needs at least one dimension");
  const chosen = typeof reward === "number" ? semconv.PRIMARY : (primary ?? (names.length === 1 ? names[0] : undefined));
  if (chosen === undefined || !(chosen in dims)) {
    throw new RangeError(`primary must name one of the reward dimensions ${JSON.stringify(names)}`);
  }
  const out: Record<string, AttributeValue> = {};
  for (const [name, value] of Object.entries(dims)) {
    if (!Number.isFinite(value)) throw new RangeError(`reward[${JSON.stringify(name)}] must be finite, got ${value}`);
    out[`${semconv.REWARD_VALUE}.${name}`] = value;
  }
  out[semconv.REWARD_PRIMARY] = chosen;
  return out;
}

/**
 * The primary reward a span's attributes carry, or undefined: this encoding, a plain number under
 * `lightning.reward`, or the reference system's plain number under `agentlightning.reward`.
 */
export function primaryReward(attrs: Record<string, AnyValue>): number | undefined {
  const primary = plainValue(attrs[semconv.REWARD_PRIMARY]);
  if (typeof primary === "string") {
    const value = plainValue(attrs[`${semconv.REWARD_VALUE}.${primary}`]);
    if (typeof value === "number") return value;
  }
  const scalar = plainValue(attrs[semconv.SPAN_REWARD]) ?? plainValue(attrs["agentlightning.reward"]);
  return typeof scalar === "number" ? scalar : undefined;
}
