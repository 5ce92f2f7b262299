/**
 * One-line `event=name key=value` logs on stderr, the format of the Python services' logs (so the same
 * tools read both). Values are clipped and their control characters escaped: no caller can forge a line.
 */
const MAX_VALUE = 200;

function field(value: unknown): string {
  let text = typeof value === "string" ? value : typeof value === "bigint" ? value.toString() : JSON.stringify(value) ?? String(value);
  if (text.length > MAX_VALUE) text = `${text.slice(0, MAX_VALUE)}…(${text.length} chars)`;
  text = text.replace(/[\u0000-\u001f\u007f]/g, (c) => `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`);
  return /[\s"=]/.test(text) ? JSON.stringify(text) : text;
}

function write(level: string, event: string, fields: Record<string, unknown>): void {
  const parts = [`event=${field(event)}`, ...Object.entries(fields).map(([k, v]) => `${k}=${field(v)}`)];
  process.stderr.write(`${new Date().toISOString()} ${level} lightning_grpc.runner ${parts.join(" ")}\n`);
}

export const log = {
  info: (event: string, fields: Record<string, unknown> = {}) => write("INFO", event, fields),
  warning: (event: string, fields: Record<string, unknown> = {}) => write("WARNING", event, fields),
};
