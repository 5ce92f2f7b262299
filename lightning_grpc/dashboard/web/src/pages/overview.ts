/** Overview: queue depth, rollouts by status, throughput and workers alive, refreshed by the watch stream. */
import { store, date } from "../api";
import { h, fmt } from "../dom";
import { keepOpen, throttle } from "../live";
import { TERMINAL, badge } from "../status";
import { RolloutStatus } from "@lightning-grpc/client/gen/lightning/v1/rollout_pb";
import { SortOrder } from "@lightning-grpc/client/gen/lightning/v1/common_pb";

const WINDOW_MS = 60_000;

export async function overview(root: HTMLElement, signal: AbortSignal): Promise<void> {
  const cards = h("div", { class: "cards" });
  const byStatus = h("div", { class: "card wide" });
  root.append(h("h1", {}, "Overview"), cards, byStatus);
  const finished: number[] = []; // end times (ms) of rollouts that finished recently

  const recent = await store.listRollouts({ orderBy: "end_time", order: SortOrder.DESCENDING, pageSize: 500 }, { signal });
  for (const r of recent.rollouts) {
    const end = date(r.endTime)?.getTime();
    if (end && Date.now() - end < WINDOW_MS) finished.push(end);
  }

  async function refresh(): Promise<void> {
    const [stats, workers] = await Promise.all([store.getStatistics({}, { signal }), store.listWorkers({ pageSize: 1000 }, { signal })]);
    const alive = workers.workers.filter((w) => {
      const beat = date(w.lastHeartbeatTime)?.getTime();
      return beat !== undefined && Date.now() - beat < 60_000;
    }).length;
    const now = Date.now();
    while (finished.length && now - (finished[0] as number) > WINDOW_MS) finished.shift();
    const count = (s: RolloutStatus) => Number(stats.rolloutsByStatus[`ROLLOUT_STATUS_${RolloutStatus[s]}`] ?? 0n);
    const card = (label: string, value: string, key: string) =>
      h("div", { class: "card stat", "data-stat": key }, h("div", { class: "stat-value" }, value), h("div", { class: "stat-label" }, label));
    cards.replaceChildren(
      card("queue depth", fmt(Number(stats.queueLength)), "queue"),
      card("running", fmt(count(RolloutStatus.RUNNING) + count(RolloutStatus.PREPARING)), "running"),
      card("finished / min", fmt(finished.length), "throughput"),
      card("workers alive", `${alive} / ${workers.workers.length}`, "workers"),
      card("rollouts", fmt(Number(stats.totalRollouts)), "rollouts"),
      card("spans", fmt(Number(stats.totalSpans)), "spans"),
    );
    const total = Math.max(1, Number(stats.totalRollouts));
    const rows = Object.entries(stats.rolloutsByStatus)
      .map(([key, n]) => [key.replace("ROLLOUT_STATUS_", "").toLowerCase(), Number(n)] as const)
      .filter(([, n]) => n > 0)
      .sort((a, b) => b[1] - a[1]);
    byStatus.replaceChildren(
      h("h2", {}, "Rollouts by status"),
      rows.length === 0
        ? h("p", { class: "muted" }, "No rollouts yet.")
        : h(
            "table",
            { class: "bars" },
            ...rows.map(([name, n]) =>
              h("tr", {}, h("td", {}, badge(name)), h("td", { class: "bar-cell" }, h("div", { class: `bar s-${name}`, style: `width:${(100 * n) / total}%` })), h("td", { class: "num" }, fmt(n))),
            ),
          ),
      h("p", { class: "muted" }, `${stats.backend} store, up ${fmt(Number(stats.uptime?.seconds ?? 0n))} s`),
    );
  }

  await refresh();
  const later = throttle(500, () => void refresh().catch(() => undefined));
  keepOpen(signal, async (s) => {
    for await (const event of store.watchRollouts({}, { signal: s })) {
      if (event.rollout && TERMINAL.has(event.rollout.status)) finished.push(Date.now());
      later();
    }
  });
}
