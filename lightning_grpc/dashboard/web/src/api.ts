/**
 * The browser's way to the services: the TypeScript client's generated contract and typed errors, over the
 * Connect protocol that `serve`'s dashboard gateway speaks (same origin). The credential, when the server
 * has auth on, is the same as for gRPC: kept in this tab's sessionStorage and sent as a bearer token.
 */
import { createClient, ConnectError, Code, type Interceptor } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-web";
import { timestampDate, type Timestamp } from "@bufbuild/protobuf/wkt";
import { StoreService } from "@lightning-grpc/client/gen/lightning/v1/store_service_pb";
import { TrainerService } from "@lightning-grpc/client/gen/lightning/v1/trainer_service_pb";
import { fromConnectError, UnauthenticatedError } from "@lightning-grpc/client/errors";

const TOKEN_KEY = "lightning-grpc.token";

export function token(): string {
  return sessionStorage.getItem(TOKEN_KEY) ?? "";
}

export function setToken(value: string): void {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

const bearer: Interceptor = (next) => async (req) => {
  const t = token();
  if (t) req.header.set("authorization", `Bearer ${t}`);
  return next(req);
};

const transport = createConnectTransport({ baseUrl: window.location.origin, interceptors: [bearer] });

export const store = createClient(StoreService, transport);
export const trainer = createClient(TrainerService, transport);

/** Whether an error means "give a credential". */
export function needsCredential(error: unknown): boolean {
  return fromConnectError(error) instanceof UnauthenticatedError;
}

/** An error as one line: its ErrorInfo reason and message (the client's typed errors). */
export function describe(error: unknown): string {
  const err = fromConnectError(error);
  return `${err.reason}: ${err.message}`;
}

/** Whether the error is the stream being closed by us (navigation). */
export function aborted(error: unknown): boolean {
  return ConnectError.from(error).code === Code.Canceled;
}

export function date(ts: Timestamp | undefined): Date | undefined {
  return ts ? timestampDate(ts) : undefined;
}

export function ago(ts: Timestamp | undefined): string {
  const d = date(ts);
  if (!d) return "–";
  const s = Math.max(0, (Date.now() - d.getTime()) / 1000);
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}
