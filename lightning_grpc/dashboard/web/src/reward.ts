/** A rollout's reward: the primary dimension of its last `lightning.reward` span (lightning_grpc/semconv.py). */
import { store, plain } from "./api";
import type { Span } from "./gen/lightning/v1/span_pb";

export const SPAN_REWARD = "lightning.reward";
export const SPAN_LLM_CALL = "lightning.llm.call";

export function rewardOf(span: Span): number | undefined {
  const primary = plain(span.attributes["lightning.reward.primary"]);
  if (typeof primary === "string") {
    const v = plain(span.attributes[`lightning.reward.value.${primary}`]);
    if (typeof v === "number") return v;
  }
  const scalar = plain(span.attributes["lightning.reward"]) ?? plain(span.attributes["agentlightning.reward"]);
  return typeof scalar === "number" ? scalar : undefined;
}

export async function rolloutReward(rolloutId: string, signal: AbortSignal): Promise<number | undefined> {
  const res = await store.listSpans({ selector: { rolloutId, attemptId: "latest", name: SPAN_REWARD }, pageSize: 100 }, { signal });
  const spans = res.spans;
  for (let i = spans.length - 1; i >= 0; i--) {
    const r = rewardOf(spans[i] as Span);
    if (r !== undefined) return r;
  }
  return undefined;
}
