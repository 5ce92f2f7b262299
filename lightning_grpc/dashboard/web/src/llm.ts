/**
 * An LLM call's conversation, read from the proxy's recorded JSON: the chat-completions request it sent to the
 * engine (`messages`, `tools`, `tool_choice`) and the response (`choices[0].message.tool_calls`), whatever
 * dialect the agent spoke. The dashboard's reader; Python's is lightning_grpc/triplets/conversation.py.
 */

export interface ToolCall {
  id: string;
  name: string;
  /** The JSON text the model wrote. */
  arguments: string;
}

export interface Message {
  role: string;
  content: string;
  toolCalls: ToolCall[];
  /** A tool result: the call it answers, and that call's tool name ("" when the prompt does not say). */
  toolCallId?: string;
  toolName?: string;
}

export interface Conversation {
  messages: Message[];
  /** The model's answer: its text and the tool calls it made. */
  reply: Message | undefined;
  tools: string[];
  toolChoice: unknown;
}

type Json = Record<string, unknown>;

function object(value: unknown): Json | undefined {
  return typeof value === "object" && value !== null && !Array.isArray(value) ? (value as Json) : undefined;
}

function objects(value: unknown): Json[] {
  return Array.isArray(value) ? value.map(object).filter((v): v is Json => v !== undefined) : [];
}

export function parseJson(text: unknown): Json | undefined {
  if (typeof text !== "string") return undefined;
  try {
    return object(JSON.parse(text));
  } catch {
    return undefined;
  }
}

/** A message's content as text: a string, the text parts of a list of parts, else its JSON. */
export function contentText(content: unknown): string {
  if (content === undefined || content === null) return "";
  if (typeof content === "string") return content;
  const parts = objects(content).map((p) => p["text"]);
  if (parts.length && parts.every((p) => typeof p === "string")) return parts.join("");
  return JSON.stringify(content);
}

export function toolCalls(value: unknown): ToolCall[] {
  return objects(value).map((call) => {
    const fn = object(call["function"]) ?? {};
    const args = fn["arguments"];
    return {
      id: String(call["id"] ?? ""),
      name: String(fn["name"] ?? "?"),
      arguments: typeof args === "string" ? args : JSON.stringify(args ?? {}),
    };
  });
}

function message(m: Json, names: Map<string, string>): Message {
  const id = m["tool_call_id"];
  const toolCallId = typeof id === "string" ? id : undefined;
  return {
    role: String(m["role"] ?? "?"),
    content: contentText(m["content"]),
    toolCalls: toolCalls(m["tool_calls"]),
    toolCallId,
    toolName: toolCallId !== undefined ? (names.get(toolCallId) ?? String(m["name"] ?? "")) : undefined,
  };
}

function offeredTools(value: unknown): string[] {
  return objects(value).map((tool) => String(object(tool["function"])?.["name"] ?? tool["name"] ?? tool["type"] ?? "?"));
}

function replyOf(response: Json | undefined): Message | undefined {
  const choice = objects(response?.["choices"])[0];
  if (!choice) return undefined;
  const m = object(choice["message"]);
  if (m) return message({ ...m, role: "assistant" }, new Map());
  return typeof choice["text"] === "string" ? { role: "assistant", content: choice["text"], toolCalls: [] } : undefined;
}

/** The conversation of one call from its recorded request and response (either may be missing). */
export function conversation(requestText: unknown, responseText: unknown): Conversation {
  const request = parseJson(requestText);
  const raw = objects(request?.["messages"]);
  const names = new Map(raw.flatMap((m) => toolCalls(m["tool_calls"]).map((c): [string, string] => [c.id, c.name])));
  const messages = raw.map((m) => message(m, names));
  if (!raw.length && request?.["prompt"] !== undefined) messages.push({ role: "prompt", content: contentText(request["prompt"]), toolCalls: [] });
  return { messages, reply: replyOf(parseJson(responseText)), tools: offeredTools(request?.["tools"]), toolChoice: request?.["tool_choice"] };
}
