/** A rollout's reward: the primary reward of its latest attempt's last `lightning.reward` span. */
import { store } from "./api";
import { primaryReward, semconv } from "@lightning-grpc/client/semconv";
import type { Span } from "@lightning-grpc/client/gen/lightning/v1/span_pb";

export function rewardOf(span: Span): number | undefined {
  return primaryReward(span.attributes);
}

export async function rolloutReward(rolloutId: string, signal: AbortSignal): Promise<number | undefined> {
  const res = await store.listSpans({ selector: { rolloutId, attemptId: "latest", name: semconv.SPAN_REWARD }, pageSize: 100 }, { signal });
  const spans = res.spans;
  for (let i = spans.length - 1; i >= 0; i--) {
    const r = rewardOf(spans[i] as Span);
    if (r !== undefined) return r;
  }
  return undefined;
}
