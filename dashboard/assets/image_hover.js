// Hover over the per-layer heatmaps, which are plotly image traces (figures/layers.py).
//
// plotly.js (4.1) reads an image's pixel under the pointer from a canvas it makes once the image has
// loaded, on the trace object of the draw that loaded it. A relayout that lands before that (a resize
// while the page is still filling) makes new trace objects and draws no trace again, so they never
// get the canvas, and every hover then throws. Before plotly sees a pointer move over a graph, give
// such a trace the canvas from its already loaded image.
document.addEventListener(
  "mousemove",
  (event) => {
    const graph = event.target instanceof Element ? event.target.closest(".js-plotly-plot") : null;
    for (const trace of (graph && graph._fullData) || []) {
      const image = trace._image;
      if (trace.type !== "image" || trace._canvas || !image || !image.complete || !image.naturalWidth) {
        continue;
      }
      const canvas = document.createElement("canvas");
      canvas.width = image.naturalWidth;
      canvas.height = image.naturalHeight;
      canvas.getContext("2d", { willReadFrequently: true }).drawImage(image, 0, 0);
      trace._canvas = { el: canvas, source: trace.source };
    }
  },
  true,
);
