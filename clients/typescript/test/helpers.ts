/**
 * Real services for the tests: `lightning-grpc serve`, `engine` and `train` from the repository's Python
 * environment, each a child process on free ports, read from their one-line logs.
 */
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

/** clients/typescript (compiled tests live in dist/test). */
export const PACKAGE = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const ROOT = resolve(PACKAGE, "..", "..");
export const CLI = process.env.LIGHTNING_GRPC_BIN ?? join(ROOT, ".venv", "bin", "lightning-grpc");
export const QUIET = { ...process.env, TOKENIZERS_PARALLELISM: "false", HF_HUB_OFFLINE: "1", TRANSFORMERS_OFFLINE: "1" };

export function tempDir(prefix = "lgrpc-ts-"): string {
  return mkdtempSync(join(tmpdir(), prefix));
}

/** A child process whose output lines are kept, with a wait for a line holding a marker. */
export class Child {
  readonly lines: string[] = [];
  private readonly waiters: (() => void)[] = [];
  private exited = false;

  constructor(readonly name: string, readonly proc: ChildProcess) {
    let partial = "";
    const take = (chunk: Buffer) => {
      partial += chunk.toString();
      const parts = partial.split("\n");
      partial = parts.pop() ?? "";
      this.lines.push(...parts);
      this.waiters.splice(0).forEach((w) => w());
    };
    proc.stdout?.on("data", take);
    proc.stderr?.on("data", take);
    proc.on("exit", () => {
      this.exited = true;
      this.waiters.splice(0).forEach((w) => w());
    });
  }

  async waitFor(marker: string, timeoutMs = 60_000): Promise<string> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const line = this.lines.find((l) => l.includes(marker));
      if (line) return line;
      if (this.exited) throw new Error(`${this.name} exited before ${marker}:\n${this.tail()}`);
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`${this.name}: no ${marker} within ${timeoutMs} ms:\n${this.tail()}`);
      await new Promise<void>((res) => {
        const timer = setTimeout(res, left);
        this.waiters.push(() => {
          clearTimeout(timer);
          res();
        });
      });
    }
  }

  tail(n = 30): string {
    return this.lines.slice(-n).join("\n");
  }

  async stop(): Promise<void> {
    if (this.exited || this.proc.exitCode !== null) return;
    const done = new Promise<void>((res) => this.proc.once("exit", () => res()));
    this.proc.kill("SIGTERM");
    const timer = setTimeout(() => this.proc.kill("SIGKILL"), 20_000);
    await done;
    clearTimeout(timer);
  }
}

export function start(name: string, command: string, args: string[], env: NodeJS.ProcessEnv = QUIET): Child {
  return new Child(name, spawn(command, args, { env, cwd: ROOT, stdio: ["ignore", "pipe", "pipe"] }));
}

/** `key=value` out of a log line. */
export function logField(line: string, key: string): string {
  const match = new RegExp(`(?:^|\\s)${key}=("(?:[^"\\\\]|\\\\.)*"|\\S+)`).exec(line);
  if (!match?.[1]) throw new Error(`no ${key}= in ${line}`);
  return match[1].startsWith('"') ? (JSON.parse(match[1]) as string) : match[1];
}

export interface Server {
  readonly child: Child;
  readonly address: string;
  readonly proxyUrl: string;
  stop(): Promise<void>;
}

/** `lightning-grpc serve` on free ports (memory store unless args name a --db or --postgres), with its proxy when asked. */
export async function startServer(args: string[] = [], env: NodeJS.ProcessEnv = QUIET): Promise<Server> {
  const child = start("server", CLI, ["serve", "--port", "0", "--grace", "1", "--no-dashboard", ...(args.some((a) => a === "--db" || a === "--postgres") ? [] : ["--memory"]), ...args], env);
  const address = logField(await child.waitFor("event=server_started"), "address");
  const proxied = args.some((a) => a.startsWith("--proxy"));
  const proxyUrl = proxied ? logField(await child.waitFor("event=proxy_started"), "http_address") : "";
  return { child, address, proxyUrl, stop: () => child.stop() };
}

/** The tiny local model (a real Qwen2 with its own tokenizer), built once per test process. */
let model: string | undefined;
export function tinyModel(): string {
  if (model) return model;
  const path = join(tempDir("lgrpc-ts-model-"), "model");
  const done = spawnSync(CLI, ["init-model", path], { env: QUIET, cwd: ROOT, encoding: "utf8", timeout: 300_000 });
  if (done.status !== 0) throw new Error(`init-model failed:\n${done.stdout}${done.stderr}`);
  model = path;
  return path;
}

/** The engine serving the tiny model on a free port; its admin key is made here. */
export async function startEngine(modelPath: string): Promise<{ child: Child; url: string }> {
  const child = start("engine", CLI, ["engine", "--model", modelPath, "--port", "0", "--served-model-name", "policy", "--threads", "1"], {
    ...QUIET,
    LIGHTNING_GRPC_ENGINE_ADMIN_KEY: "test-admin-key",
  });
  const address = logField(await child.waitFor("event=engine_started", 120_000), "address");
  return { child, url: `http://${address}` };
}

/** A command of the Python CLI, run to its end; its stdout. */
export function cli(args: string[], env: NodeJS.ProcessEnv = QUIET): string {
  const done = spawnSync(CLI, args, { env, cwd: ROOT, encoding: "utf8", timeout: 120_000 });
  if (done.status !== 0) throw new Error(`lightning-grpc ${args.join(" ")} failed:\n${done.stdout}${done.stderr}`);
  return done.stdout;
}

export async function eventually<T>(what: string, probe: () => Promise<T | undefined>, timeoutMs = 30_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const got = await probe();
    if (got !== undefined) return got;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** The repository's Python (for its test helpers run as modules). */
export const PYTHON = process.env.LIGHTNING_GRPC_PYTHON ?? join(ROOT, ".venv", "bin", "python");

/**
 * A throwaway PostgreSQL server with one database (tests/store/postgres_server.py), or why none can be
 * started here (no PostgreSQL, no psycopg): `{ reason }`.
 */
export async function startPostgres(): Promise<{ url: string; child: Child } | { reason: string }> {
  const child = start("postgres", PYTHON, ["-m", "tests.store.postgres_server"]);
  const line = await child.waitFor("=", 120_000);
  if (line.startsWith("unavailable=")) return { reason: line.slice("unavailable=".length) };
  return { url: logField(line, "url"), child };
}

/** A TCP port free on 127.0.0.1 now. */
export async function freePort(): Promise<number> {
  const { createServer } = await import("node:net");
  return new Promise((resolvePort, reject) => {
    const probe = createServer();
    probe.once("error", reject);
    probe.listen(0, "127.0.0.1", () => {
      const address = probe.address();
      probe.close(() => resolvePort(typeof address === "object" && address ? address.port : 0));
    });
  });
}

/**
 * A TCP relay on 127.0.0.1 to `target` ("host:port"). `hold()` stops passing on what the client sends (it
 * waits unread, as at a server that stopped); `reset()` breaks every connection through it with a TCP reset,
 * as a server's machine that went away does. Connections made afterwards are relayed again.
 */
export async function startRelay(
  target: string,
): Promise<{ address: string; hold: () => void; reset: () => number; close: () => Promise<void> }> {
  const { createServer, connect } = await import("node:net");
  const [host, port] = [target.slice(0, target.lastIndexOf(":")), Number(target.slice(target.lastIndexOf(":") + 1))];
  const pairs = new Set<[import("node:net").Socket, import("node:net").Socket]>();
  const relay = createServer((downstream) => {
    const upstream = connect(port, host);
    const pair: [typeof downstream, typeof upstream] = [downstream, upstream];
    pairs.add(pair);
    const drop = () => {
      pairs.delete(pair);
      downstream.destroy();
      upstream.destroy();
    };
    downstream.on("error", drop).on("close", drop).pipe(upstream);
    upstream.on("error", drop).on("close", drop).pipe(downstream);
  });
  await new Promise<void>((resolveListen) => relay.listen(0, "127.0.0.1", resolveListen));
  const address = relay.address();
  return {
    address: `127.0.0.1:${typeof address === "object" && address ? address.port : 0}`,
    hold: () => {
      for (const [downstream, upstream] of pairs) {
        downstream.unpipe(upstream);
        downstream.pause();
      }
    },
    reset: () => {
      const broken = pairs.size;
      for (const [downstream, upstream] of [...pairs]) {
        downstream.resetAndDestroy();
        upstream.destroy();
      }
      return broken;
    },
    close: () =>
      new Promise<void>((resolveClose) => {
        relay.close(() => resolveClose());
        for (const [downstream, upstream] of [...pairs]) {
          downstream.destroy();
          upstream.destroy();
        }
      }),
  };
}
