/** Rollouts: filter, sort, page, each with its reward; rows change and new rollouts appear as the watch says. */
import { store, ago } from "../api";
import { h, fmt } from "../dom";
import { keepOpen } from "../live";
import { badge, rolloutStatus, TERMINAL } from "../status";
import { rolloutReward } from "../reward";
import { RolloutMode, RolloutStatus, type Rollout } from "@lightning-grpc/client/gen/lightning/v1/rollout_pb";
import { SortOrder } from "@lightning-grpc/client/gen/lightning/v1/common_pb";

const PAGE_SIZE = 25;

function select(name: string, options: [string, string][], value: string): HTMLSelectElement {
  const el = h("select", { name }, ...options.map(([v, label]) => h("option", { value: v, selected: v === value }, label)));
  return el;
}

export async function rollouts(root: HTMLElement, signal: AbortSignal): Promise<void> {
  const params = new URLSearchParams(window.location.hash.split("?")[1] ?? "");
  const state = {
    status: params.get("status") ?? "",
    mode: params.get("mode") ?? "",
    contains: params.get("q") ?? "",
    orderBy: params.get("sort") ?? "create_time",
    order: params.get("order") ?? "desc",
  };
  const tokens: string[] = [""]; // page tokens of the pages seen, for "previous"
  let page = 0;

  const statusSel = select("status", [["", "any status"], ...[1, 2, 3, 4, 5, 6, 7].map((s) => [String(s), rolloutStatus(s)] as [string, string])], state.status);
  const modeSel = select("mode", [["", "any mode"], ["1", "train"], ["2", "val"], ["3", "test"]], state.mode);
  const sortSel = select("sort", ["create_time", "start_time", "end_time", "rollout_id", "status"].map((k) => [k, k.replace("_", " ")] as [string, string]), state.orderBy);
  const orderSel = select("order", [["desc", "newest first"], ["asc", "oldest first"]], state.order);
  const search = h("input", { type: "search", name: "q", placeholder: "rollout id contains…", value: state.contains });
  const body = h("tbody");
  const info = h("span", { class: "muted" });
  const prev = h("button", { type: "button", disabled: true }, "‹ previous");
  const next = h("button", { type: "button", disabled: true }, "next ›");
  root.append(
    h("h1", {}, "Rollouts"),
    h("form", { class: "filters", onsubmit: (e: Event) => (e.preventDefault(), apply()) }, statusSel, modeSel, search, sortSel, orderSel, h("button", { type: "submit" }, "Filter")),
    h("table", { class: "list rollouts" }, h("thead", {}, h("tr", {}, ...["rollout", "status", "mode", "group", "attempts", "worker", "reward", "created", "duration"].map((c) => h("th", {}, c)))), body),
    h("div", { class: "pager" }, prev, info, next),
  );
  for (const el of [statusSel, modeSel, sortSel, orderSel]) el.addEventListener("change", () => apply());
  prev.addEventListener("click", () => void load(page - 1));
  next.addEventListener("click", () => void load(page + 1));

  const rows = new Map<string, HTMLTableRowElement>();

  function apply(): void {
    state.status = statusSel.value;
    state.mode = modeSel.value;
    state.orderBy = sortSel.value;
    state.order = orderSel.value;
    state.contains = search.value.trim();
    tokens.length = 1;
    void load(0);
  }

  function matches(r: Rollout): boolean {
    return (
      (!state.status || r.status === Number(state.status)) &&
      (!state.mode || r.mode === Number(state.mode)) &&
      (!state.contains || r.rolloutId.includes(state.contains))
    );
  }

  function row(r: Rollout): HTMLTableRowElement {
    const status = rolloutStatus(r.status);
    const reward = h("td", { class: "num reward" }, "…");
    const start = r.startTime ? Number(r.startTime.seconds) + r.startTime.nanos / 1e9 : undefined;
    const end = r.endTime ? Number(r.endTime.seconds) + r.endTime.nanos / 1e9 : undefined;
    const tr = h(
      "tr",
      { "data-rollout-id": r.rolloutId, "data-status": status },
      h("td", {}, h("a", { href: `#/rollouts/${encodeURIComponent(r.rolloutId)}` }, r.rolloutId)),
      h("td", {}, badge(status)),
      h("td", {}, r.mode ? (RolloutMode[r.mode] ?? "").toLowerCase() : "–"),
      h("td", { class: "muted" }, r.groupId || "–"),
      h("td", { class: "num" }, r.attemptCount),
      h("td", { class: "muted" }, r.latestAttempt?.workerId || "–"),
      reward,
      h("td", { class: "muted" }, ago(r.createTime)),
      h("td", { class: "num" }, start && end ? `${fmt(end - start, 2)} s` : "–"),
    );
    if (TERMINAL.has(r.status) || r.status === RolloutStatus.RUNNING) {
      void rolloutReward(r.rolloutId, signal).then((v) => (reward.textContent = fmt(v, 3)), () => (reward.textContent = "–"));
    } else reward.textContent = "–";
    return tr;
  }

  // Only the latest load renders (a slower, older one must not overwrite it), and changes the watch
  // reports while a load is in flight are applied once it has rendered.
  let latestLoad = 0;
  let loading = false;
  let missed: Rollout[] = [];

  async function load(to: number): Promise<void> {
    const mine = ++latestLoad;
    loading = true;
    let res;
    try {
      res = await store.listRollouts(
      {
        statuses: state.status ? [Number(state.status)] : [],
        mode: state.mode ? Number(state.mode) : RolloutMode.UNSPECIFIED,
        rolloutIdContains: state.contains,
        orderBy: state.orderBy,
        order: state.order === "asc" ? SortOrder.ASCENDING : SortOrder.DESCENDING,
        pageSize: PAGE_SIZE,
        pageToken: tokens[to] ?? "",
      },
      { signal },
      );
    } catch (error) {
      if (mine === latestLoad) loading = false;
      throw error;
    }
    if (mine !== latestLoad) return;
    page = to;
    tokens[to + 1] = res.nextPageToken;
    rows.clear();
    body.replaceChildren(...res.rollouts.map((r) => {
      const tr = row(r);
      rows.set(r.rolloutId, tr);
      return tr;
    }));
    if (res.rollouts.length === 0) body.append(h("tr", { class: "empty" }, h("td", { colspan: 9, class: "muted" }, "No rollout matches.")));
    const from = to * PAGE_SIZE;
    info.textContent = `${res.rollouts.length ? from + 1 : 0}–${from + res.rollouts.length} of ${res.totalSize}`;
    prev.disabled = to === 0;
    next.disabled = !res.nextPageToken;
    body.dataset["view"] = `${state.orderBy}:${state.order}:${state.status}:${state.mode}:${state.contains}:${to}`;
    loading = false;
    const seen = missed;
    missed = [];
    seen.forEach(follow);
  }

  /** A change the watch reported: its row follows it, or a new rollout appears on top of the first page. */
  function follow(r: Rollout): void {
    if (loading) {
      missed.push(r);
      return;
    }
    const old = rows.get(r.rolloutId);
    if (old) {
      const fresh = row(r);
      old.replaceWith(fresh);
      rows.set(r.rolloutId, fresh);
      fresh.classList.add("flash");
    } else if (page === 0 && state.order === "desc" && state.orderBy === "create_time" && matches(r)) {
      body.querySelector("tr.empty")?.remove();
      const fresh = row(r);
      body.prepend(fresh);
      rows.set(r.rolloutId, fresh);
      fresh.classList.add("flash", "new");
      while (body.children.length > PAGE_SIZE) {
        const last = body.lastElementChild as HTMLElement;
        rows.delete(last.dataset["rolloutId"] ?? "");
        last.remove();
      }
    }
  }

  await load(0);
  keepOpen(signal, async (s) => {
    for await (const event of store.watchRollouts({}, { signal: s })) {
      if (event.rollout) follow(event.rollout);
    }
  });
}
