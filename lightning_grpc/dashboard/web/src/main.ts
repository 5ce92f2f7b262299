/** The dashboard's shell: hash routes, the credential prompt, and one live page at a time. */
import "./style.css";
import { h } from "./dom";
import { describe, needsCredential, setToken, store } from "./api";
import { overview } from "./pages/overview";
import { rollouts } from "./pages/rollouts";
import { rolloutDetail } from "./pages/rollout";
import { workers } from "./pages/workers";
import { training } from "./pages/training";

export type Page = (root: HTMLElement, signal: AbortSignal, params: string[]) => Promise<void>;

const app = document.getElementById("app") as HTMLElement;
let current: AbortController | undefined;

function route(): { name: string; page: Page; params: string[] } {
  const parts = window.location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  if (parts[0] === "rollouts" && parts[1]) return { name: "rollouts", page: rolloutDetail, params: [parts[1]] };
  if (parts[0] === "rollouts") return { name: "rollouts", page: rollouts, params: [] };
  if (parts[0] === "workers") return { name: "workers", page: workers, params: [] };
  if (parts[0] === "training") return { name: "training", page: training, params: [] };
  return { name: "overview", page: overview, params: [] };
}

async function show(): Promise<void> {
  current?.abort();
  const controller = new AbortController();
  current = controller;
  const { name, page, params } = route();
  for (const link of document.querySelectorAll<HTMLAnchorElement>("nav a")) {
    link.classList.toggle("active", link.dataset["page"] === name);
  }
  const root = h("div", { class: "page", "data-page": name });
  app.replaceChildren(root);
  try {
    await page(root, controller.signal, params);
  } catch (error) {
    if (controller.signal.aborted) return;
    if (needsCredential(error)) {
      app.replaceChildren(login(describe(error)));
    } else {
      root.append(h("p", { class: "error" }, describe(error)));
    }
  }
}

function login(why: string): HTMLElement {
  const input = h("input", { type: "password", name: "token", placeholder: "admin token or credential", autocomplete: "off" });
  const form = h(
    "form",
    {
      class: "card login",
      onsubmit: (e: Event) => {
        e.preventDefault();
        setToken(input.value.trim());
        void show();
      },
    },
    h("h2", {}, "This server needs a credential"),
    h("p", { class: "muted" }, why),
    h("p", {}, "The same token as the API (", h("code", {}, "serve --token"), "), kept in this tab only."),
    input,
    h("button", { type: "submit" }, "Open"),
  );
  return form;
}

window.addEventListener("hashchange", () => void show());
void show();

