/**
 * The typed errors of lightning-grpc, rebuilt from what the server sends: a gRPC status code plus a
 * `google.rpc.ErrorInfo` (domain "lightning-grpc.dev", a stable `reason`, the ids in `metadata`).
 * The same table as the Python client's `lightning_grpc.errors`: one class per status code, the reason
 * refines it, and `transient` is the one retry-or-give-up decision every sender asks.
 */
import { Code, ConnectError } from "@connectrpc/connect";
import { ErrorInfoSchema } from "./gen/google/rpc/error_details_pb.js";

/** The ErrorInfo domain of every error the server raises. Part of the contract. */
export const ERROR_DOMAIN = "lightning-grpc.dev";

/** Reasons worth retrying although their status code is not: the store frees room, a disk gets space. */
export const TRANSIENT_REASONS: ReadonlySet<string> = new Set(["STORE_MEMORY_FULL", "STORE_OUT_OF_SPACE"]);

/** Base class. `reason` is the stable ErrorInfo reason; `metadata` repeats the ids the error is about. */
export class LightningError extends Error {
  static readonly codeName: string = "UNKNOWN";
  static readonly retryable: boolean = false;
  readonly code: Code;
  readonly reason: string;
  readonly metadata: Readonly<Record<string, string>>;

  constructor(message: string, options: { code?: Code; reason?: string; metadata?: Record<string, string>; cause?: unknown } = {}) {
    super(message, { cause: options.cause });
    const cls = this.constructor as typeof LightningError;
    this.name = cls.name;
    this.code = options.code ?? CODE_OF_NAME[cls.codeName] ?? Code.Unknown;
    this.reason = options.reason || cls.codeName;
    this.metadata = Object.freeze({ ...(options.metadata ?? {}) });
  }

  /** The gRPC status code's name, as the Python client spells it (e.g. "NOT_FOUND"). */
  get codeName(): string {
    return (this.constructor as typeof LightningError).codeName;
  }

  /** Whether sending the same request again may succeed. */
  get transient(): boolean {
    return (this.constructor as typeof LightningError).retryable || TRANSIENT_REASONS.has(this.reason);
  }
}

export class NotFoundError extends LightningError { static override readonly codeName = "NOT_FOUND"; }
export class InvalidArgumentError extends LightningError {
  static override readonly codeName = "INVALID_ARGUMENT";
  /** The request field the server named (ErrorInfo metadata "field"), "" when none. */
  get field(): string {
    return this.metadata["field"] ?? "";
  }
}
export class FailedPreconditionError extends LightningError { static override readonly codeName = "FAILED_PRECONDITION"; }
export class AlreadyExistsError extends LightningError { static override readonly codeName = "ALREADY_EXISTS"; }
export class AbortedError extends LightningError { static override readonly codeName = "ABORTED"; }
export class ResourceExhaustedError extends LightningError { static override readonly codeName = "RESOURCE_EXHAUSTED"; }
export class OutOfRangeError extends LightningError { static override readonly codeName = "OUT_OF_RANGE"; }
export class UnauthenticatedError extends LightningError { static override readonly codeName = "UNAUTHENTICATED"; }
export class PermissionDeniedError extends LightningError { static override readonly codeName = "PERMISSION_DENIED"; }
export class UnavailableError extends LightningError {
  static override readonly codeName = "UNAVAILABLE";
  static override readonly retryable = true;
}
export class DeadlineExceededError extends LightningError {
  static override readonly codeName = "DEADLINE_EXCEEDED";
  static override readonly retryable = true;
}
export class InternalError extends LightningError { static override readonly codeName = "INTERNAL"; }

const CLASSES = [
  NotFoundError,
  InvalidArgumentError,
  FailedPreconditionError,
  AlreadyExistsError,
  AbortedError,
  ResourceExhaustedError,
  OutOfRangeError,
  UnauthenticatedError,
  PermissionDeniedError,
  UnavailableError,
  DeadlineExceededError,
  InternalError,
] as const;

const CODE_OF_NAME: Record<string, Code> = {
  NOT_FOUND: Code.NotFound,
  INVALID_ARGUMENT: Code.InvalidArgument,
  FAILED_PRECONDITION: Code.FailedPrecondition,
  ALREADY_EXISTS: Code.AlreadyExists,
  ABORTED: Code.Aborted,
  RESOURCE_EXHAUSTED: Code.ResourceExhausted,
  OUT_OF_RANGE: Code.OutOfRange,
  UNAUTHENTICATED: Code.Unauthenticated,
  PERMISSION_DENIED: Code.PermissionDenied,
  UNAVAILABLE: Code.Unavailable,
  DEADLINE_EXCEEDED: Code.DeadlineExceeded,
  INTERNAL: Code.Internal,
  UNKNOWN: Code.Unknown,
};

const CLASS_OF_CODE = new Map<Code, typeof LightningError>(
  CLASSES.map((cls) => [CODE_OF_NAME[cls.codeName] as Code, cls]),
);

/**
 * Node's error codes for a connection that broke or could not be made. A call that fails with one of them
 * was answered by no server: it is UNAVAILABLE, as gRPC itself reports a lost connection (and the Python
 * client sees it). Connect's Node transport gives a reset connection the code ABORTED and most of the others
 * INTERNAL, which would read as a server's refusal, and a sender would give up what it had sent.
 */
export const CONNECTION_LOST_CODES: ReadonlySet<string> = new Set([
  "ECONNRESET",
  "ECONNREFUSED",
  "ECONNABORTED",
  "EPIPE",
  "ETIMEDOUT",
  "ENETDOWN",
  "ENETUNREACH",
  "EHOSTDOWN",
  "EHOSTUNREACH",
  "ERR_HTTP2_GOAWAY_SESSION",
  "ERR_HTTP2_INVALID_SESSION",
  "ERR_HTTP2_SESSION_ERROR",
]);

/** The Node error code, among CONNECTION_LOST_CODES, in an error's chain of causes; undefined when none. */
export function connectionLostCode(error: unknown): string | undefined {
  const seen = new Set<unknown>();
  for (let cause = error; cause instanceof Error && !seen.has(cause); cause = cause.cause) {
    seen.add(cause);
    const code = (cause as { code?: unknown }).code;
    if (typeof code === "string" && CONNECTION_LOST_CODES.has(code)) return code;
  }
  return undefined;
}

/** The typed error a call failed with: status code → class, ErrorInfo → reason and metadata. */
export function fromConnectError(error: unknown): LightningError {
  if (error instanceof LightningError) return error;
  const err = ConnectError.from(error);
  if (err.code !== Code.Unavailable && connectionLostCode(error) !== undefined) {
    return new UnavailableError(`connection lost: ${err.rawMessage}`, { code: Code.Unavailable, cause: error });
  }
  let reason = "";
  let metadata: Record<string, string> = {};
  for (const info of err.findDetails(ErrorInfoSchema)) {
    if (info.domain === ERROR_DOMAIN) {
      reason = info.reason;
      metadata = { ...info.metadata };
      break;
    }
  }
  return errorFromStatus(err.code, err.rawMessage, reason, metadata, error);
}

/** The typed error of a status code, message and ErrorInfo reason (e.g. a span batch's BatchError). */
export function errorFromStatus(
  code: Code | number,
  message: string,
  reason = "",
  metadata: Record<string, string> = {},
  cause?: unknown,
): LightningError {
  const cls = CLASS_OF_CODE.get(code as Code) ?? LightningError;
  return new cls(message, { code: code as Code, reason: reason || undefined, metadata, cause });
}

/** Run a call, turning whatever it throws into a LightningError. */
export async function typed<T>(call: () => Promise<T>): Promise<T> {
  try {
    return await call();
  } catch (error) {
    throw fromConnectError(error);
  }
}
