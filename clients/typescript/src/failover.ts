/**
 * One transport over the several addresses of a store: its writer and its standbys, given as one target
 * `"10.0.0.1:4747,10.0.0.2:4747"` (the same form as the Python client's and the CLI's `--store`).
 *
 * It does what the Python client's channel does (gRPC's pick_first over an address list): calls go to the
 * address that answered last. A call that no server took, because nobody listens there (a standby listens
 * only once it holds the writer lease) or because the server there refused it as not the one to take it
 * (UNAVAILABLE with reason NOT_THE_WRITER or SHUTTING_DOWN), goes on to the next address at once, each
 * address tried once per call. A call cut off after a server took it (its connection lost) is not sent
 * again here: later calls start from the next address, and the caller's retry (RetryConfig, for the
 * methods the contract marks safe to repeat) or its own reconnect decides about this one.
 */
import type { DescMessage, DescMethodStreaming, DescMethodUnary, MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type ContextValues, type StreamResponse, type Transport, type UnaryResponse } from "@connectrpc/connect";
import { connectionLostCode, fromConnectError, UnavailableError } from "./errors.js";

/** Reasons of an UNAVAILABLE that a server gives for a call it did not take: another server should. */
const ELSEWHERE_REASONS = new Set(["NOT_THE_WRITER", "SHUTTING_DOWN"]);

/** The addresses of a target: several comma-separated `host:port` (or URLs), or one. */
export function targetAddresses(target: string): string[] {
  const addresses = target
    .split(",")
    .map((part) => part.trim())
    .filter((part) => part.length > 0);
  if (addresses.length === 0) throw new Error(`the target ${JSON.stringify(target)} names no address`);
  return addresses;
}

/** Whether a call failed before any server took it: nobody listening, or a server that sent it elsewhere. */
export function notTaken(error: unknown): boolean {
  if (!(error instanceof ConnectError) || error.code !== Code.Unavailable) return false;
  if (connectionLostCode(error) === "ECONNREFUSED") return true;
  return ELSEWHERE_REASONS.has(fromConnectError(error).reason);
}

function lostConnection(error: unknown): boolean {
  return fromConnectError(error) instanceof UnavailableError;
}

/** `input` for one try of a streaming call: whether the try began reading it is noted in `read`. */
function tryInput<T>(input: AsyncIterable<T>, read: { began: boolean; it?: AsyncIterator<T> }): AsyncIterable<T> {
  return {
    [Symbol.asyncIterator]: () => ({
      next: () => {
        read.began = true;
        read.it ??= input[Symbol.asyncIterator]();
        return read.it.next();
      },
      return: async (value?: unknown) => (read.it?.return ? read.it.return(value) : { done: true, value }),
      throw: async (error?: unknown) => {
        if (read.it?.throw) return read.it.throw(error);
        throw error;
      },
    }),
  };
}

export class FailoverTransport implements Transport {
  /** The index (in `addresses`) of the address calls go to first. */
  private current = 0;

  constructor(
    private readonly transports: readonly Transport[],
    readonly addresses: readonly string[],
  ) {
    if (transports.length === 0 || transports.length !== addresses.length) {
      throw new Error("a failover transport needs one transport per address, and at least one");
    }
  }

  /** The address calls go to first now (the one that answered last). */
  get address(): string {
    return this.addresses[this.current] as string;
  }

  unary<I extends DescMessage, O extends DescMessage>(
    method: DescMethodUnary<I, O>,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
    header: HeadersInit | undefined,
    input: MessageInitShape<I>,
    contextValues?: ContextValues,
  ): Promise<UnaryResponse<I, O>> {
    return this.tryEach((t) => t.unary(method, signal, timeoutMs, header, input, contextValues), () => true);
  }

  async stream<I extends DescMessage, O extends DescMessage>(
    method: DescMethodStreaming<I, O>,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
    header: HeadersInit | undefined,
    input: AsyncIterable<MessageInitShape<I>>,
    contextValues?: ContextValues,
  ): Promise<StreamResponse<I, O>> {
    const read: { began: boolean; it?: AsyncIterator<MessageInitShape<I>> } = { began: false };
    let index = this.current;
    const response = await this.tryEach(
      (t, i) => {
        index = i;
        return t.stream(method, signal, timeoutMs, header, tryInput(input, read), contextValues);
      },
      () => !read.began, // a request already read from the caller cannot be sent again from here
    );
    return { ...response, message: this.watched(response.message, index) };
  }

  private async tryEach<R>(call: (t: Transport, index: number) => Promise<R>, mayMoveOn: () => boolean): Promise<R> {
    const first = this.current;
    let last: unknown;
    for (let i = 0; i < this.transports.length; i++) {
      const index = (first + i) % this.transports.length;
      try {
        const result = await call(this.transports[index] as Transport, index);
        this.current = index;
        return result;
      } catch (error) {
        last = error;
        if (notTaken(error) && mayMoveOn()) continue;
        if (lostConnection(error)) this.moveOnFrom(index);
        throw error;
      }
    }
    throw last;
  }

  /** A stream's messages; a stream cut off (UNAVAILABLE) sends later calls to the next address first. */
  private async *watched<M>(messages: AsyncIterable<M>, index: number): AsyncIterable<M> {
    try {
      yield* messages;
    } catch (error) {
      if (lostConnection(error)) this.moveOnFrom(index);
      throw error;
    }
  }

  private moveOnFrom(index: number): void {
    if (this.current === index) this.current = (index + 1) % this.transports.length;
  }
}
