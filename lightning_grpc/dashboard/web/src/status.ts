import { RolloutStatus, AttemptStatus } from "@lightning-grpc/client/gen/lightning/v1/rollout_pb";
import { WorkerStatus } from "@lightning-grpc/client/gen/lightning/v1/worker_pb";
import { h } from "./dom";

export function rolloutStatus(s: RolloutStatus): string {
  return (RolloutStatus[s] ?? "UNSPECIFIED").toLowerCase();
}
export function attemptStatus(s: AttemptStatus): string {
  return (AttemptStatus[s] ?? "UNSPECIFIED").toLowerCase();
}
export function workerStatus(s: WorkerStatus): string {
  return (WorkerStatus[s] ?? "UNSPECIFIED").toLowerCase();
}
export function badge(name: string): HTMLElement {
  return h("span", { class: `badge s-${name}` }, name);
}
export const TERMINAL = new Set([RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED]);
