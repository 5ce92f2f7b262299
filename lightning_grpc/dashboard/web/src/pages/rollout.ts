/**
 * One rollout: its attempts, the span tree with timings, each LLM call with its messages, token counts,
 * log-probs and policy version, the reward and any error. Spans and status arrive live while it runs.
 */
import { store, ago } from "../api";
import { h, fmt } from "../dom";
import { keepOpen, throttle } from "../live";
import { badge, rolloutStatus, attemptStatus, TERMINAL } from "../status";
import { rewardOf } from "../reward";
import { conversation, type Message, type ToolCall } from "../llm";
import { plainValue as plain, semconv } from "@lightning-grpc/client/semconv";
import { SpanStatusCode, type Span } from "@lightning-grpc/client/gen/lightning/v1/span_pb";
import type { Rollout, Attempt } from "@lightning-grpc/client/gen/lightning/v1/rollout_pb";
import { toJson } from "@bufbuild/protobuf";
import { ValueSchema } from "@bufbuild/protobuf/wkt";


function count(value: unknown, fallback: unknown): number | undefined {
  if (Array.isArray(value)) return value.length;
  return typeof fallback === "number" ? fallback : undefined;
}

function toolCall(call: ToolCall): HTMLElement {
  return h(
    "div",
    { class: "tool-call", "data-tool-call-id": call.id },
    h("span", { class: "tool-name" }, call.name),
    h("code", { class: "tool-args" }, call.arguments),
    call.id ? h("span", { class: "muted" }, ` ${call.id}`) : null,
  );
}

function messageRow(m: Message, reply = false): HTMLElement {
  const result = m.toolCallId !== undefined;
  return h(
    "div",
    { class: `msg role-${m.role}${reply ? " reply" : ""}${result ? " tool-result" : ""}`, "data-tool-call-id": m.toolCallId },
    h("span", { class: "role" }, reply ? "reply" : result ? `${m.toolName || "tool"} →` : m.role),
    h("span", { class: "content" }, m.content, ...m.toolCalls.map(toolCall)),
  );
}

function llmCall(span: Span): HTMLElement {
  const at = (k: string) => plain(span.attributes[k]);
  const talk = conversation(at(semconv.LLM_REQUEST), at(semconv.LLM_RESPONSE));
  const promptTokens = count(at(semconv.LLM_PROMPT_TOKEN_IDS), at(semconv.LLM_USAGE_PROMPT_TOKENS));
  const responseTokens = count(at(semconv.LLM_RESPONSE_TOKEN_IDS), at(semconv.LLM_USAGE_COMPLETION_TOKENS));
  const logprobs = (at(semconv.LLM_RESPONSE_LOGPROBS) as number[] | undefined) ?? [];
  const reply = talk.reply;
  const error = at(semconv.LLM_ERROR);
  const choice = talk.toolChoice === undefined ? "" : ` (tool_choice ${typeof talk.toolChoice === "string" ? talk.toolChoice : JSON.stringify(talk.toolChoice)})`;
  return h(
    "div",
    { class: "llm-call", "data-span-id": span.spanId },
    h(
      "dl",
      { class: "facts" },
      h("dt", {}, "model"), h("dd", {}, String(at(semconv.LLM_MODEL) ?? "–")),
      h("dt", {}, "dialect"), h("dd", { "data-field": "dialect" }, String(at(semconv.LLM_DIALECT) ?? "–")),
      h("dt", {}, "policy version"), h("dd", { "data-field": "policy-version" }, String(at(semconv.LLM_POLICY_VERSION) ?? "–")),
      h("dt", {}, "prompt tokens"), h("dd", { "data-field": "prompt-tokens" }, fmt(promptTokens)),
      h("dt", {}, "response tokens"), h("dd", { "data-field": "response-tokens" }, fmt(responseTokens)),
      h("dt", {}, "finish"), h("dd", { "data-field": "finish" }, String(at(semconv.LLM_FINISH_REASON) ?? "–")),
      h("dt", {}, "latency"), h("dd", {}, at(semconv.LLM_LATENCY_MS) !== undefined ? `${fmt(Number(at(semconv.LLM_LATENCY_MS)), 1)} ms` : "–"),
      ...(talk.tools.length ? [h("dt", {}, "tools"), h("dd", { "data-field": "tools" }, `${talk.tools.join(", ")}${choice}`)] : []),
    ),
    error ? h("p", { class: "error" }, String(error)) : null,
    h(
      "div",
      { class: "messages" },
      ...talk.messages.map((m) => messageRow(m)),
      reply && (reply.content || reply.toolCalls.length) ? messageRow(reply, true) : null,
    ),
    logprobs.length
      ? h(
          "div",
          { class: "logprobs", "data-field": "logprobs" },
          h("span", { class: "muted" }, "log-probs "),
          ...logprobs.map((lp, i) => h("span", { class: "lp", title: `token ${i}: p=${Math.exp(lp).toFixed(3)}`, style: `--p:${Math.exp(lp).toFixed(3)}` }, lp.toFixed(2))),
        )
      : null,
  );
}

function tree(spans: Span[]): HTMLElement {
  if (spans.length === 0) return h("p", { class: "muted" }, "No spans yet.");
  const ids = new Set(spans.map((s) => s.spanId));
  const children = new Map<string, Span[]>();
  for (const s of spans) {
    const parent = s.parentSpanId && ids.has(s.parentSpanId) ? s.parentSpanId : "";
    children.set(parent, [...(children.get(parent) ?? []), s]);
  }
  const t0 = Math.min(...spans.map((s) => Number(s.startTimeUnixNano)));
  const t1 = Math.max(...spans.map((s) => Number(s.endTimeUnixNano || s.startTimeUnixNano)));
  const total = Math.max(1, t1 - t0);
  const node = (s: Span, depth: number): HTMLElement[] => {
    const start = Number(s.startTimeUnixNano);
    const end = Number(s.endTimeUnixNano || s.startTimeUnixNano);
    const ms = (end - start) / 1e6;
    const reward = s.name === semconv.SPAN_REWARD ? rewardOf(s) : undefined;
    const attrs = Object.entries(s.attributes)
      .filter(([k]) => !k.startsWith(semconv.LLM_PREFIX))
      .map(([k, v]) => {
        const value = plain(v);
        const text = typeof value === "string" ? value : JSON.stringify(value);
        return h("div", { class: "attr" }, h("span", { class: "k" }, k), " ", h("span", { class: "v" }, text && text.length > 300 ? `${text.slice(0, 300)}…` : text));
      });
    const row = h(
      "details",
      { class: `span${s.status?.code === SpanStatusCode.ERROR ? " span-error" : ""}`, "data-span-name": s.name, open: s.name === semconv.SPAN_LLM_CALL || depth === 0 },
      h(
        "summary",
        { style: `--depth:${depth}` },
        h("span", { class: "span-name" }, s.name, reward !== undefined ? h("span", { class: "badge reward" }, `reward ${fmt(reward, 3)}`) : null),
        h("span", { class: "span-time" }, `${fmt(ms, 1)} ms`),
        h("span", { class: "timeline" }, h("span", { class: "timebar", style: `left:${(100 * (start - t0)) / total}%;width:${Math.max(0.5, (100 * (end - start)) / total)}%` })),
      ),
      s.status?.code === SpanStatusCode.ERROR ? h("p", { class: "error" }, s.status.message) : null,
      s.name === semconv.SPAN_LLM_CALL ? llmCall(s) : attrs.length ? h("div", { class: "attrs" }, ...attrs) : null,
    );
    return [row, ...(children.get(s.spanId) ?? []).sort((a, b) => Number(a.startTimeUnixNano - b.startTimeUnixNano)).flatMap((c) => node(c, depth + 1))];
  };
  const roots = (children.get("") ?? []).sort((a, b) => Number(a.startTimeUnixNano - b.startTimeUnixNano));
  return h("div", { class: "span-tree" }, ...roots.flatMap((r) => node(r, 0)));
}

function attemptRow(a: Attempt): HTMLElement {
  const error = (a.metadata?.["error"] ?? undefined) as { type?: string; message?: string; traceback?: string } | undefined;
  return h(
    "div",
    { class: "attempt", "data-attempt-id": a.attemptId },
    h("span", { class: "muted" }, `#${a.sequenceNumber}`), " ",
    h("code", {}, a.attemptId), " ", badge(attemptStatus(a.status)), " ",
    h("span", { class: "muted" }, `${a.workerId || "no worker"}, started ${ago(a.startTime)}`),
    a.statusMessage ? h("p", { class: "error" }, a.statusMessage) : null,
    error?.traceback ? h("details", {}, h("summary", {}, `${error.type ?? "error"}: ${error.message ?? ""}`), h("pre", {}, error.traceback)) : null,
  );
}

export async function rolloutDetail(root: HTMLElement, signal: AbortSignal, [rolloutId]: string[]): Promise<void> {
  const id = rolloutId as string;
  const head = h("div", { class: "card" });
  const attemptsBox = h("div", { class: "card" });
  const spansBox = h("div", { class: "card" });
  root.append(h("p", {}, h("a", { href: "#/rollouts" }, "‹ rollouts")), h("h1", {}, "Rollout ", h("code", {}, id)), head, attemptsBox, spansBox);
  let rollout: Rollout = (await store.getRollout({ rolloutId: id }, { signal })).rollout as Rollout;
  const spans = new Map<string, Span>();
  let token = "";
  do {
    const res = await store.listSpans({ selector: { rolloutId: id }, pageToken: token, pageSize: 1000 }, { signal });
    for (const s of res.spans) spans.set(s.spanId, s);
    token = res.nextPageToken;
  } while (token);

  const renderHead = () => {
    const rewards = [...spans.values()].filter((s) => s.name === semconv.SPAN_REWARD && s.attemptId === rollout.latestAttempt?.attemptId).map(rewardOf).filter((r) => r !== undefined);
    const input = rollout.input ? JSON.stringify(toJson(ValueSchema, rollout.input), null, 1) : "";
    head.replaceChildren(
      h(
        "dl",
        { class: "facts" },
        h("dt", {}, "status"), h("dd", { "data-field": "status" }, badge(rolloutStatus(rollout.status))),
        h("dt", {}, "reward"), h("dd", { "data-field": "reward" }, fmt(rewards[rewards.length - 1] as number | undefined, 3)),
        h("dt", {}, "group"), h("dd", {}, rollout.groupId || "–"),
        h("dt", {}, "created"), h("dd", {}, ago(rollout.createTime)),
        h("dt", {}, "attempts"), h("dd", {}, String(rollout.attemptCount)),
      ),
      rollout.statusMessage ? h("p", { class: "error" }, rollout.statusMessage) : "",
      h("details", {}, h("summary", {}, "input"), h("pre", {}, input.length > 20000 ? `${input.slice(0, 20000)}…` : input)),
    );
  };
  const renderAttempts = async () => {
    const res = await store.listAttempts({ rolloutId: id, pageSize: 100 }, { signal });
    attemptsBox.replaceChildren(h("h2", {}, "Attempts"), ...res.attempts.map(attemptRow));
  };
  const renderSpans = () => {
    const llmCalls = [...spans.values()].filter((s) => s.name === semconv.SPAN_LLM_CALL).length;
    spansBox.replaceChildren(h("h2", {}, `Spans (${spans.size}, ${llmCalls} LLM call${llmCalls === 1 ? "" : "s"})`), tree([...spans.values()]));
  };
  renderHead();
  await renderAttempts();
  renderSpans();

  if (!TERMINAL.has(rollout.status)) {
    const redraw = throttle(300, () => {
      renderHead();
      renderSpans();
    });
    keepOpen(signal, async (s) => {
      for await (const res of store.tailSpans({ selector: { rolloutId: id }, follow: true }, { signal: s })) {
        for (const span of res.spans) spans.set(span.spanId, span);
        redraw();
      }
    });
    keepOpen(signal, async (s) => {
      for await (const event of store.watchRollouts({ rolloutIds: [id] }, { signal: s })) {
        if (!event.rollout) continue;
        rollout = event.rollout;
        renderHead();
        await renderAttempts();
      }
    });
  }
}
