/**
 * The Proxy's client (lightning_grpc.client.ProxyClient in Python), for trainers and operators: the LLM
 * backends behind the proxy, an attempt's own endpoint, pause, resume, drain and status. Same transport as
 * the Store's client, same method names in camelCase, same argument order, durations in seconds.
 */
import type { MessageInitShape } from "@bufbuild/protobuf";
import { durationFromMs } from "@bufbuild/protobuf/wkt";
import type { Client, Transport } from "@connectrpc/connect";
import { clientConfig, createTransport, DEFAULT_TARGET, ms, typedClient, type ClientConfig } from "./client.js";
import type { LlmEndpoint } from "./gen/lightning/v1/resource_pb.js";
import {
  BackendDialect,
  ProxyService,
  type Backend,
  type BackendSchema,
  type GetProxyStatusResponse,
} from "./gen/lightning/v1/proxy_service_pb.js";

export { BackendDialect };
export type { Backend };
/** A backend to set: the contract's Backend as a message init. */
export type BackendInit = MessageInitShape<typeof BackendSchema>;
/** What GetProxyStatus answers: paused or not, calls in flight, totals and per-backend counts. */
export type ProxyStatus = GetProxyStatusResponse;

/** The Proxy's client (the ProxyService is on the Store's port when `serve` hosts the proxy). */
export class ProxyClient {
  readonly config: ReturnType<typeof clientConfig>;
  readonly transport: Transport;
  /** The generated client: every ProxyService RPC with its generated types, typed errors included. */
  readonly raw: Client<typeof ProxyService>;

  constructor(config: string | ClientConfig = DEFAULT_TARGET) {
    this.config = clientConfig(config);
    this.transport = createTransport(this.config);
    this.raw = typedClient(ProxyService, this.transport);
  }

  /** Replace the backends; returns them as the proxy keeps them (API keys are not sent back). */
  async setBackends(backends: readonly BackendInit[]): Promise<Backend[]> {
    return (await this.raw.setBackends({ backends: [...backends] })).backends;
  }

  async listBackends(): Promise<Backend[]> {
    return (await this.raw.listBackends({})).backends;
  }

  /** The OpenAI-compatible endpoint of one attempt (its own URL under the proxy) and its model. */
  async attemptEndpoint(rolloutId: string, attemptId: string, modelName = ""): Promise<{ endpoint: string; model: string }> {
    const endpoint: LlmEndpoint | undefined = (await this.raw.getAttemptEndpoint({ rolloutId, attemptId, modelName })).endpoint;
    return { endpoint: endpoint?.endpoint ?? "", model: endpoint?.model ?? "" };
  }

  /** Refuse new LLM calls (with `retryAfter` seconds as the hint); returns the calls in flight. */
  async pause(reason = "", retryAfter?: number): Promise<number> {
    const res = await this.raw.pause({ reason, retryAfter: retryAfter === undefined ? undefined : durationFromMs(ms(retryAfter)) });
    return res.inFlight;
  }

  async resume(): Promise<void> {
    await this.raw.resume({});
  }

  /** Wait until no call is in flight, up to `timeout` seconds; returns the calls still in flight (0: drained). */
  async drain(timeout = 60): Promise<number> {
    const res = await this.raw.drain({ timeout: durationFromMs(ms(timeout)) }, { timeoutMs: ms(timeout + this.config.timeout) });
    return res.inFlight;
  }

  async status(): Promise<ProxyStatus> {
    return this.raw.getProxyStatus({});
  }
}
