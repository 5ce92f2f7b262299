/** lightning-grpc's TypeScript client: the generated contract, the Store, Trainer and Proxy clients, spans and a runner. */
export * from "./client.js";
export { FailoverTransport, targetAddresses } from "./failover.js";
export * from "./trainer.js";
export * from "./proxy.js";
export * from "./errors.js";
export * from "./spans.js";
export * from "./semconv.js";
export * from "./runner.js";
export { installOtlpTracing, attemptContext, otlpConfigured } from "./otel.js";
export { StoreService } from "./gen/lightning/v1/store_service_pb.js";
export { TrainerService } from "./gen/lightning/v1/trainer_service_pb.js";
export { ProxyService } from "./gen/lightning/v1/proxy_service_pb.js";
export type { AnyValue } from "./gen/lightning/v1/common_pb.js";
