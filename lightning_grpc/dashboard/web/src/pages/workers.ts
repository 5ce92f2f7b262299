/** Workers: each runner process, its state, its last heartbeat and what it reported. */
import { store, ago, date } from "../api";
import { h } from "../dom";
import { keepOpen, throttle } from "../live";
import { badge, workerStatus } from "../status";

export async function workers(root: HTMLElement, signal: AbortSignal): Promise<void> {
  const body = h("tbody");
  root.append(
    h("h1", {}, "Workers"),
    h("table", { class: "list workers" }, h("thead", {}, h("tr", {}, ...["worker", "state", "alive", "last heartbeat", "current rollout", "stats"].map((c) => h("th", {}, c)))), body),
  );
  async function load(): Promise<void> {
    const res = await store.listWorkers({ pageSize: 1000 }, { signal });
    body.replaceChildren(
      ...res.workers.map((w) => {
        const beat = date(w.lastHeartbeatTime)?.getTime();
        const alive = beat !== undefined && Date.now() - beat < 60_000;
        const stats = Object.entries(w.heartbeatStats ?? {})
          .slice(0, 8)
          .map(([k, v]) => `${k}=${typeof v === "number" ? Math.round(v * 100) / 100 : JSON.stringify(v)}`)
          .join("  ");
        return h(
          "tr",
          { "data-worker-id": w.workerId },
          h("td", {}, h("code", {}, w.workerId)),
          h("td", {}, badge(workerStatus(w.status))),
          h("td", {}, alive ? badge("alive") : badge("silent")),
          h("td", { class: "muted" }, ago(w.lastHeartbeatTime)),
          h("td", {}, w.currentRolloutId ? h("a", { href: `#/rollouts/${encodeURIComponent(w.currentRolloutId)}` }, w.currentRolloutId) : "–"),
          h("td", { class: "muted small" }, stats),
        );
      }),
    );
    if (res.workers.length === 0) body.append(h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No worker has called in yet.")));
  }
  await load();
  // Workers change as they claim and finish rollouts: the rollout watch says when to look again.
  const later = throttle(1000, () => void load().catch(() => undefined));
  keepOpen(signal, async (s) => {
    for await (const _ of store.watchRollouts({}, { signal: s })) later();
  });
}
