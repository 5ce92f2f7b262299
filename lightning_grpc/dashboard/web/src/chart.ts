/** A line chart in SVG: x is the step, y one metric; re-drawn as points arrive. */
import { h, svg, fmt } from "./dom";

export class LineChart {
  readonly element: HTMLElement;
  private readonly points: [number, number][] = [];
  private readonly plot: SVGSVGElement;
  private readonly last: HTMLElement;

  constructor(readonly title: string, readonly metric: string, private readonly color = "#4f7cff") {
    this.plot = svg("svg", { viewBox: "0 0 420 180", class: "chart", role: "img", "aria-label": title });
    this.last = h("span", { class: "chart-last" }, " –");
    this.element = h("figure", { class: "card chart-card", "data-metric": metric }, h("figcaption", {}, title, this.last), this.plot);
    this.draw();
  }

  get size(): number {
    return this.points.length;
  }

  add(x: number, y: number): void {
    if (!Number.isFinite(y)) return;
    const at = this.points.findIndex(([px]) => px === x);
    if (at >= 0) this.points[at] = [x, y];
    else this.points.push([x, y]);
    this.points.sort((a, b) => a[0] - b[0]);
    this.draw();
  }

  private draw(): void {
    const [W, H, L, R, T, B] = [420, 180, 44, 10, 10, 24];
    this.plot.replaceChildren();
    if (this.points.length === 0) {
      this.plot.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "chart-empty" }, "no steps yet"));
      return;
    }
    const xs = this.points.map((p) => p[0]);
    const ys = this.points.map((p) => p[1]);
    let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
    if (y0 === y1) [y0, y1] = [y0 - Math.abs(y0 || 1) * 0.1, y1 + Math.abs(y1 || 1) * 0.1];
    const px = (x: number) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const py = (y: number) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    for (const y of [y0, (y0 + y1) / 2, y1]) {
      this.plot.append(svg("line", { x1: L, x2: W - R, y1: py(y), y2: py(y), class: "grid" }));
      this.plot.append(svg("text", { x: L - 4, y: py(y) + 4, "text-anchor": "end", class: "tick" }, fmt(y, 3)));
    }
    this.plot.append(svg("text", { x: L, y: H - 6, class: "tick" }, `step ${x0}`));
    this.plot.append(svg("text", { x: W - R, y: H - 6, "text-anchor": "end", class: "tick" }, `step ${x1}`));
    const d = this.points.map(([x, y], i) => `${i ? "L" : "M"}${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
    this.plot.append(svg("path", { d, fill: "none", stroke: this.color, "stroke-width": 2 }));
    for (const [x, y] of this.points) {
      this.plot.append(svg("circle", { cx: px(x), cy: py(y), r: 2.5, fill: this.color }, svg("title", {}, `step ${x}: ${fmt(y, 4)}`)));
    }
    const lastPoint = this.points[this.points.length - 1] as [number, number];
    this.last.textContent = ` ${fmt(lastPoint[1], 4)}`;
  }
}
