/**
 * The stock OpenTelemetry JS SDK with its OTLP/gRPC exporter, configured only by the standard `OTEL_*`
 * variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `..._HEADERS` such as
 * `authorization=Bearer%20<credential>`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`). The Store's
 * gRPC port takes OTLP `TraceService/Export`, so pointing the endpoint at it is all an agent needs.
 *
 * Spans are attributed to an attempt by their `lightning.rollout_id` / `lightning.attempt_id` attributes;
 * `attemptContext` parents them under the attempt's root span, in the rollout's trace.
 */
import { ROOT_CONTEXT, TraceFlags, trace, type Context } from "@opentelemetry/api";
import { OTLPTraceExporter } from "@opentelemetry/exporter-trace-otlp-grpc";
import { detectResources, envDetector, resourceFromAttributes } from "@opentelemetry/resources";
import { BatchSpanProcessor, TracerProvider } from "@opentelemetry/sdk-trace";

/** Whether the environment names an OTLP endpoint for traces. */
export function otlpConfigured(env: NodeJS.ProcessEnv = process.env): boolean {
  return Boolean(env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT || env.OTEL_EXPORTER_OTLP_ENDPOINT) && env.OTEL_TRACES_EXPORTER !== "none";
}

/**
 * Install a global tracer provider exporting over OTLP/gRPC when the environment asks for it; returns
 * its shutdown (which flushes), or undefined when OTLP is not configured (the API then records nothing).
 */
export function installOtlpTracing(serviceName = "lightning-grpc-agent"): (() => Promise<void>) | undefined {
  if (!otlpConfigured()) return undefined;
  const resource = resourceFromAttributes({ "service.name": process.env.OTEL_SERVICE_NAME || serviceName }).merge(
    detectResources({ detectors: [envDetector] }),
  );
  const provider = new TracerProvider({
    resource,
    spanProcessors: [new BatchSpanProcessor({ exporter: new OTLPTraceExporter() })],
  });
  trace.setGlobalTracerProvider(provider);
  return () => provider.shutdown();
}

/** A context whose parent is the attempt's root span (trace and span ids in hex), for `tracer.startSpan`. */
export function attemptContext(traceId: string, rootSpanId: string): Context {
  return trace.setSpanContext(ROOT_CONTEXT, {
    traceId,
    spanId: rootSpanId,
    traceFlags: TraceFlags.SAMPLED,
    isRemote: true,
  });
}
