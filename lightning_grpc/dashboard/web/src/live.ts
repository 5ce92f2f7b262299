/** Live views: a watch stream kept open while the page is shown, and the header's dot saying so. */
import { aborted } from "./api";

export function setLive(on: boolean): void {
  document.getElementById("live")?.classList.toggle("down", !on);
}

/**
 * Run `open` (a server stream's reader) until the page goes away; when the stream breaks, open it again
 * after a pause. `open` gets the signal to pass to the call.
 */
export function keepOpen(signal: AbortSignal, open: (signal: AbortSignal) => Promise<void>): void {
  void (async () => {
    while (!signal.aborted) {
      try {
        setLive(true);
        await open(signal);
      } catch (error) {
        if (signal.aborted || aborted(error)) return;
        setLive(false);
        console.warn("live stream broke; reopening", error);
      }
      await new Promise((r) => setTimeout(r, 1000));
    }
  })();
}

/** Calls `fn` at most once per `ms`, the last call winning. */
export function throttle(ms: number, fn: () => void): () => void {
  let timer: ReturnType<typeof setTimeout> | undefined;
  return () => {
    if (timer) return;
    timer = setTimeout(() => {
      timer = undefined;
      fn();
    }, ms);
  };
}
