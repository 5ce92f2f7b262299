/**
 * Training: the runs and steps TrainerService was told of, with reward, KL, clip fraction and step time, and
 * the run's interruptions (a process that died, why, how the run recovered and how long it took), live.
 */
import { trainer, date } from "../api";
import { h, fmt } from "../dom";
import { LineChart } from "../chart";
import { keepOpen } from "../live";
import type { TrainingEvent } from "@lightning-grpc/client/gen/lightning/v1/trainer_service_pb";
import { RolloutMode } from "@lightning-grpc/client/gen/lightning/v1/rollout_pb";

const CHARTS: [string, string, string][] = [
  ["reward (training rollouts)", "reward_mean", "#2fb37a"],
  ["validation reward", "val_reward", "#8a63d2"],
  ["KL (policy vs. sampler)", "ppo_kl", "#e0803a"],
  ["clip fraction", "pg_clipfrac", "#d94f70"],
  ["step time (s)", "step_seconds", "#4f7cff"],
];

export async function training(root: HTMLElement, signal: AbortSignal): Promise<void> {
  const status = h("div", { class: "cards" });
  const runsBox = h("div", { class: "runs" });
  const charts = h("div", { class: "charts" });
  const stepsBody = h("tbody");
  const interruptionsBody = h("tbody");
  const interruptionsTable = h("table", { class: "list interruptions", hidden: true }, h("thead", {}, h("tr", {}, ...["time", "step", "process", "cause", "recovery", "recovery s"].map((c) => h("th", {}, c)))), interruptionsBody);
  const noInterruption = h("p", { class: "muted no-interruptions" }, "None: no process of this run was interrupted.");
  root.append(
    h("h1", {}, "Training"),
    status,
    runsBox,
    charts,
    h("div", { class: "card wide", "data-section": "interruptions" }, h("h2", {}, "Interruptions"), noInterruption, interruptionsTable),
    h("div", { class: "card wide" }, h("h2", {}, "Steps"), h("table", { class: "list steps" }, h("thead", {}, h("tr", {}, ...["run", "step", "policy", "reward", "KL", "clip frac", "step s", "time"].map((c) => h("th", {}, c)))), stepsBody)),
  );

  const events: TrainingEvent[] = [];
  const runs = new Map<string, number>();
  let shown = "";
  let plots = new Map<string, LineChart>();

  const renderStatus = async () => {
    const s = await trainer.getTrainerStatus({}, { signal });
    const train = s.groups.find((g) => g.mode === RolloutMode.TRAIN);
    const card = (label: string, value: string, key: string) => h("div", { class: "card stat", "data-stat": key }, h("div", { class: "stat-value" }, value), h("div", { class: "stat-label" }, label));
    status.replaceChildren(
      card("policy version", fmt(Number(s.policyVersion)), "policy"),
      card("batches served", fmt(Number(s.batches)), "batches"),
      card("rows trained", fmt(Number(s.rows)), "rows"),
      card("groups pending / ready", `${train?.pending ?? 0} / ${train?.ready ?? 0}`, "groups"),
    );
  };

  const renderRuns = () => {
    runsBox.replaceChildren(
      ...[...runs.entries()].map(([run, steps]) =>
        h("button", { type: "button", class: run === shown ? "run active" : "run", "data-run": run, onclick: () => show(run) }, `${run || "(unnamed run)"} · ${steps} steps`),
      ),
    );
    if (runs.size === 0) runsBox.append(h("p", { class: "muted" }, "No training step reported yet. Steps appear here as a training run reports them."));
  };

  const show = (run: string) => {
    shown = run;
    plots = new Map(CHARTS.map(([title, metric, color]) => [metric, new LineChart(title, metric, color)]));
    charts.replaceChildren(...[...plots.values()].map((p) => p.element));
    stepsBody.replaceChildren();
    interruptionsBody.replaceChildren();
    for (const e of events) if (e.runId === run) plot(e);
    renderRuns();
  };

  /** The event's interruptions, newest first above the earlier ones; "none" while the run has had none. */
  const listInterruptions = (e: TrainingEvent) => {
    for (const i of e.interruptions) {
      interruptionsBody.prepend(
        h(
          "tr",
          { "data-interruption": i.process, "data-step": String(i.step) },
          h("td", { class: "muted" }, date(i.time)?.toLocaleString() ?? "–"),
          h("td", { class: "num" }, String(i.step)),
          h("td", {}, i.process),
          h("td", { class: "small" }, i.cause || "–"),
          h("td", { class: "small" }, i.recovery || "–"),
          h("td", { class: "num" }, fmt(i.recoverySeconds, 1)),
        ),
      );
    }
    const any = interruptionsBody.childElementCount > 0;
    interruptionsTable.hidden = !any;
    noInterruption.hidden = any;
  };

  const plot = (e: TrainingEvent) => {
    listInterruptions(e);
    for (const [metric, chart] of plots) {
      const v = e.metrics[metric];
      if (v !== undefined) chart.add(Number(e.step), v);
    }
    stepsBody.prepend(
      h(
        "tr",
        { "data-step": String(e.step) },
        h("td", {}, e.runId || "–"),
        h("td", { class: "num" }, String(e.step)),
        h("td", { class: "num" }, String(e.policyVersion)),
        h("td", { class: "num" }, fmt(e.metrics["reward_mean"], 3)),
        h("td", { class: "num" }, fmt(e.metrics["ppo_kl"], 4)),
        h("td", { class: "num" }, fmt(e.metrics["pg_clipfrac"], 3)),
        h("td", { class: "num" }, fmt(e.metrics["step_seconds"], 2)),
        h("td", { class: "muted" }, date(e.time)?.toLocaleTimeString() ?? "–"),
      ),
    );
  };

  await renderStatus();
  renderRuns();
  show("");
  let after = 0n;
  keepOpen(signal, async (s) => {
    for await (const res of trainer.watchTraining({ afterSequence: after, follow: true }, { signal: s })) {
      const e = res.event;
      if (!e) continue;
      after = e.sequence;
      events.push(e);
      const first = !runs.has(e.runId);
      runs.set(e.runId, (runs.get(e.runId) ?? 0) + 1);
      if (first && (runs.size === 1 || shown === "")) show(e.runId);
      else if (e.runId === shown) plot(e);
      renderRuns();
      void renderStatus().catch(() => undefined);
    }
  });
}
