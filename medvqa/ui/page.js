// The page's own script: page.py hands this function, from its first line "() => {", to gr.Blocks as `js`,
// and Gradio runs it once when the page has loaded. What it does:
// - A slider's number box reports its value when it loses focus (Gradio's "release"): Enter there applies
//   the value typed, as Tab would, and the box keeps the focus.
// - The window sliders report a change on "release" only, which the arrow, Page and Home/End keys never
//   send: a key that moved one sends it, as letting go of a drag does.
// - The viewer announces what is shown (a new scan, frame or window) to a screen reader, once it is shown.
// - The chat scrolls to the end of each update, as Gradio's autoscroll does, but where the latest answer
//   is taller than the chat, to the answer's first line, which holds the answer or "Uncertain" (its sources
//   follow); Gradio's own scroll stops once the view is off the end, so the page keeps scrolling itself.
// - The mouse wheel over the scan scrolls a series' slices; a drag on it sets the window.
// - The scan can be zoomed and its grey levels inverted (for the eye only: the model sees the whole scan as it
//   is) and moved while zoomed.
// - "Skip to the question" (the page's first link, shown on focus) puts the focus in the question box.
// - Gradio's accordions say whether they are open (aria-expanded, from the "open" class Gradio sets), and
//   their ▼ sign is not read out.
// - A screen reader is given each finished answer once (see `speak`), not the chat's every token.
() => {
  const KEYS = ["ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown", "PageUp", "PageDown", "Home", "End"];
  // A window or frame box emptied and left would report 0 (a centre of 0 applied without a word): it gets
  // the value it had back first (in the capture phase, before Gradio's own blur handler reads it).
  const numberBox = (target) => target instanceof HTMLInputElement && target.type === "number"
    && target.closest("#medvqa-center, #medvqa-width, #medvqa-frame");
  const lastValue = new WeakMap();
  document.addEventListener("focus", (event) => {
    if (numberBox(event.target) && event.target.value.trim() !== "") lastValue.set(event.target, event.target.value);
  }, true);
  document.addEventListener("blur", (event) => {
    const box = event.target;
    if (numberBox(box) && box.value.trim() === "" && lastValue.has(box)) {
      box.value = lastValue.get(box);
      box.dispatchEvent(new Event("input", {bubbles: true}));
    }
  }, true);
  document.addEventListener("keydown", (event) => {
    const box = event.target;
    if (event.key === "Enter" && box instanceof HTMLInputElement && box.type === "number"
        && box.closest("#medvqa-center, #medvqa-width, #medvqa-frame")) {
      event.preventDefault();
      box.blur();
      box.focus();
    }
  });
  document.addEventListener("keyup", (event) => {
    const range = event.target;
    if (KEYS.includes(event.key) && range instanceof HTMLInputElement && range.type === "range"
        && range.closest("#medvqa-center, #medvqa-width")) {
      range.dispatchEvent(new PointerEvent("pointerup", {bubbles: true}));
    }
  });
  // The wheel over the scan scrolls a series' slices, as in a PACS viewer (one slice a notch; a touchpad's
  // small steps add up); over a single image, at the first or last slice, or sideways, the page scrolls as
  // usual. The listener sits on the viewer only, so it never holds up the page's own scrolling elsewhere.
  let wheeled = 0;
  const onWheel = (event) => {
    if (ruler && ruler.drawing) {  // a line being drawn stays on its slice
      event.preventDefault();
      return;
    }
    const range = document.querySelector("#medvqa-frame input[type=range]");
    if (event.ctrlKey && event.deltaY && event.target.closest && event.target.closest("#medvqa-scan")) {
      event.preventDefault();  // Ctrl+wheel (and a touchpad's pinch) over the scan zooms it, not the page
      const frame = event.target.closest(".medvqa-frame"), box = frame.getBoundingClientRect();
      const delta = event.deltaMode === 0 ? event.deltaY : event.deltaY * 40;
      zoomTo(zoom.scale * Math.exp(-delta / 300), event.clientX - box.left, event.clientY - box.top);
      return;
    }
    if (!range || range.offsetParent === null || event.ctrlKey || !event.deltaY) return;
    stopPlaying();  // the reader takes the slices in hand
    wheeled += event.deltaMode === 0 ? event.deltaY : event.deltaY * 40;
    const step = Math.sign(wheeled);
    const value = Math.min(Number(range.max), Math.max(Number(range.min), Number(range.value) + step));
    if (value === Number(range.value)) {  // at the end of the series: the page scrolls on
      wheeled = 0;
      return;
    }
    event.preventDefault();
    if (Math.abs(wheeled) < 40) return;
    wheeled = 0;
    range.value = String(value);
    range.dispatchEvent(new Event("input", {bubbles: true}));
  };
  const hookViewer = () => {  // (settle calls it: the viewer is drawn after this script runs)
    const viewer = document.querySelector("#medvqa-viewer");
    if (viewer && !viewer.dataset.medvqaWheel) {
      viewer.dataset.medvqaWheel = "1";
      viewer.addEventListener("wheel", onWheel, {passive: false});
    }
  };
  // Dragging on the scan sets its window, as in a PACS viewer: right widens it, down raises its centre (darker);
  // each pixel dragged moves it by a thousandth of the slider's range (at least one of its steps). The image
  // follows several times a second while dragging (each as a release of the width slider, which reports both
  // values); the viewer is marked busy meanwhile, so a screen reader reads its caption once, at the end.
  let drag = null;
  const stepOf = (range) => Number(range.step) || 1;
  const slid = (range, value) => {
    const low = Number(range.min), high = Number(range.max), step = stepOf(range);
    const snapped = Math.min(high, Math.max(low, low + Math.round((value - low) / step) * step));
    const text = String(Number(snapped.toFixed((String(range.step).split(".")[1] || "").length)));
    if (Number(text) === Number(range.value)) return false;
    range.value = text;
    range.dispatchEvent(new Event("input", {bubbles: true}));
    return true;
  };
  const windowed = () => drag.width.dispatchEvent(new PointerEvent("pointerup", {bubbles: true}));
  const endDrag = () => {
    if (!drag) return;
    if (drag.moved) windowed();
    document.querySelector("#medvqa-viewer")?.removeAttribute("aria-busy");
    drag = null;
  };
  document.addEventListener("pointerdown", (event) => {
    if (!event.target.closest || !event.target.closest("#medvqa-scan")) return;
    const center = document.querySelector("#medvqa-center input[type=range]");
    const width = document.querySelector("#medvqa-width input[type=range]");
    const windowable = center && width && center.offsetParent !== null;
    if (probing && event.button === 0 && !event.shiftKey) {  // the value of the pixel here, from the server
      event.preventDefault();
      const img = event.target.closest("#medvqa-scan"), [x, y] = shownPoint(img, event);
      marker = {key: frameKey(img), x, y, click: ++probes};
      drawRuler();
      staleValues();  // the last point's value goes until this one's comes
      const box = document.querySelector("#medvqa-probe-at textarea, #medvqa-probe-at input");
      if (box) {
        box.value = `${(x / Number(img.getAttribute("width"))).toFixed(6)},`
          + `${(y / Number(img.getAttribute("height"))).toFixed(6)},${marker.click},${marker.key}`;
        box.dispatchEvent(new Event("input", {bubbles: true}));
      }
      return;
    }
    if (measuring && event.button === 0 && !event.shiftKey) {  // a line drawn from here to where it is let go
      event.preventDefault();
      const img = event.target.closest("#medvqa-scan"), [x, y] = shownPoint(img, event);
      ruler = {key: frameKey(img), x0: x, y0: y, x1: x, y1: y, drawing: true};
      // The length is read out once, when the line is let go, not at each move.
      document.querySelector("#medvqa-zoom output.medvqa-length")?.setAttribute("aria-busy", "true");
      drawRuler();
      return;
    }
    if (zoomed() && (event.shiftKey || event.button === 1 || (event.button === 0 && !windowable))) {
      event.preventDefault();  // a zoomed scan moved: Shift+drag, the middle button, or any drag where the
      const frame = event.target.closest(".medvqa-frame");  // scan has no window to set
      pan = {x: event.clientX, y: event.clientY, left: frame.scrollLeft, top: frame.scrollTop, frame};
      frame.classList.add("medvqa-panning");
      return;
    }
    if (event.button !== 0 || !windowable) return;
    event.preventDefault();  // no native image drag (and no focus change: a number box being typed in is left
    document.activeElement?.blur?.();  // here, so that its value applies first, as a click elsewhere would)
    drag = {x: event.clientX, y: event.clientY, center, width, from: [Number(center.value), Number(width.value)],
            sent: Date.now(), moved: false};
    document.querySelector("#medvqa-viewer")?.setAttribute("aria-busy", "true");
  });
  document.addEventListener("pointermove", (event) => {
    if (ruler && ruler.drawing) {
      if (!(event.buttons & 1) || !zoom.img) {
        endRuler();
        return;
      }
      [ruler.x1, ruler.y1] = shownPoint(zoom.img, event);
      drawRuler();
      return;
    }
    if (pan) {
      if (!(event.buttons & 5)) {
        endPan();
        return;
      }
      pan.frame.scrollLeft = pan.left - (event.clientX - pan.x);
      pan.frame.scrollTop = pan.top - (event.clientY - pan.y);
      return;
    }
    if (!drag) return;
    if (!(event.buttons & 1)) {  // the button was let go where no pointerup reached the page
      endDrag();
      return;
    }
    const per = (range) => Math.max(stepOf(range), (Number(range.max) - Number(range.min)) / 1000);
    const centred = slid(drag.center, drag.from[0] + (event.clientY - drag.y) * per(drag.center));
    const widened = slid(drag.width, drag.from[1] + (event.clientX - drag.x) * per(drag.width));
    drag.moved = drag.moved || centred || widened;
    if (drag.moved && Date.now() - drag.sent > 250) {
      drag.sent = Date.now();
      windowed();
    }
  });
  document.addEventListener("pointerup", (event) => {
    if (event.isTrusted) {  // (the release dispatched above bubbles here too)
      endDrag();
      endPan();
      endRuler();
    }
  });
  document.addEventListener("pointercancel", () => {  // a touch the browser took for scrolling the page
    endDrag();
    endPan();
    endRuler();
  });
  // Zoom: the scan drawn larger inside its frame, which then scrolls (its scroll bars, the arrow keys once it
  // has the focus, a drag as above). Ctrl+wheel zooms about the pointer; the buttons and the + - 0 keys (the
  // focus on the scan or the buttons) about the middle. Kept across the frames and windows of one file or
  // series (the figure's data-view) so a region can be followed through the slices; the next scan is shown whole.
  const ZOOMS = [1, 1.25, 1.5, 2, 3, 4, 6, 8];
  // `inverted`: the scan's grey levels shown inverted (a CSS filter, for the eye only), kept like the zoom.
  const zoom = {view: null, scale: 1, x: 0.5, y: 0.5, img: null, inverted: false};
  const zoomed = () => zoom.scale > 1;  // (zoomTo keeps it at 1 or above 1.01)
  // The zoomed scan's width: its place (x, y) is read and set against this same number, so that reading it
  // back from where it was put gives it again, slice after slice.
  const wideOf = (frame) => frame.offsetWidth * zoom.scale;
  let pan = null;
  const endPan = () => {
    if (!pan) return;
    pan.frame.classList.remove("medvqa-panning");
    pan = null;
  };
  const placeZoom = () => {  // the scan at zoom.scale with its point (x, y) in the frame's middle
    const img = document.querySelector("#medvqa-scan");
    const bar = document.querySelector("#medvqa-zoom");
    if (bar) bar.hidden = !img;
    zoom.img = img;
    if (!img) return;
    const view = img.closest("[data-view]")?.dataset.view ?? "";
    if (view !== zoom.view) Object.assign(zoom, {view, scale: 1, x: 0.5, y: 0.5, inverted: false});
    img.classList.toggle("medvqa-inverted", zoom.inverted);
    if (ruler && ruler.key !== frameKey(img)) ruler = null;  // a line belongs to the frame it was drawn on
    if (marker && marker.key !== frameKey(img)) marker = null;
    frameOf(img).classList.toggle("medvqa-measuring", measuring || probing);
    const frame = img.parentElement;
    frame.classList.toggle("medvqa-zoomed", zoomed());
    if (bar) {
      bar.querySelector("output.medvqa-level").textContent = `${Math.round(zoom.scale * 100)} %`;
      bar.querySelector("[data-zoom=out]").disabled = !zoomed();
      bar.querySelector("[data-zoom=fit]").disabled = !zoomed();
      bar.querySelector("[data-zoom=in]").disabled = zoom.scale >= ZOOMS[ZOOMS.length - 1];
      bar.querySelector("[data-invert]").setAttribute("aria-pressed", String(zoom.inverted));
      showPlaying();
    }
    img.dataset.placed = placed();
    frame.tabIndex = 0;  // a stop for the keys: + − 0, and the arrows once zoomed (its label, in viewer.py)
    const shape = (Number(img.getAttribute("height")) || 1) / (Number(img.getAttribute("width")) || 1);
    // A scan taller than wide is shown whole within 80 % of the window's height: its frame is narrowed (the
    // zoom's sizes all follow the frame's width).
    const narrowest = `${Math.floor(Math.min(640, 0.8 * window.innerHeight / shape))}px`;
    if (frame.style.maxWidth !== narrowest) frame.style.maxWidth = narrowest;
    if (!zoomed()) {
      img.style.width = img.style.maxWidth = frame.style.height = "";
      drawRuler();
      return;
    }
    const wide = wideOf(frame), high = wide * shape;
    frame.style.height = `${frame.offsetWidth * shape}px`;
    img.style.maxWidth = "none";
    img.style.width = `${wide}px`;
    frame.scrollLeft = zoom.x * wide - frame.clientWidth / 2;
    frame.scrollTop = zoom.y * high - frame.clientHeight / 2;
    drawRuler();
  };
  // Measuring: with Measure pressed, a drag on the scan draws a line and says how long it is: in mm from the
  // DICOM's pixel spacing (the figure's data-measure, viewer._measure_scale; "at the detector" for a
  // radiograph's imager spacing), else in the scan's own pixels. A line belongs to its frame: another frame,
  // slice or scan clears it, a new window or zoom keeps it. Esc ends measuring.
  // The Value tool: a click asks the server for the pixel's value there (the hidden #medvqa-probe-at box,
  // handlers.probe), which comes back in #medvqa-probe marked with the frame it was read on; a marker shows
  // the point. Both go with another frame, as a line does.
  let measuring = false, ruler = null;  // ruler: {key, x0, y0, x1, y1} in the shown image's pixels
  let probing = false, marker = null, probes = 0;  // marker: {key, x, y}
  const SVG = "http://www.w3.org/2000/svg";
  const frameOf = (img) => img.parentElement;
  const frameKey = (img) => {
    const figure = img.closest("[data-view]");
    return figure ? `${figure.dataset.view}:${figure.dataset.frame}` : "";
  };
  const shownPoint = (img, event) => {
    const box = img.getBoundingClientRect();
    const w = Number(img.getAttribute("width")) || 1, h = Number(img.getAttribute("height")) || 1;
    return [Math.min(w, Math.max(0, (event.clientX - box.left) * w / box.width)),
            Math.min(h, Math.max(0, (event.clientY - box.top) * h / box.height))];
  };
  const drawRuler = () => {
    const img = zoom.img, length = document.querySelector("#medvqa-zoom output.medvqa-length");
    const old = img ? frameOf(img).querySelector("svg.medvqa-overlay") : null;
    if (length && !ruler) length.textContent = "";
    if (!img || (!ruler && !marker)) {
      old?.remove();
      return;
    }
    let svg = old;
    if (!svg) {
      svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("class", "medvqa-overlay");
      svg.setAttribute("aria-hidden", "true");
      svg.setAttribute("preserveAspectRatio", "none");
      for (const name of ["medvqa-ruler-shadow", "medvqa-ruler"]) {
        const line = document.createElementNS(SVG, "line");
        line.setAttribute("class", name);
        svg.appendChild(line);
      }
      for (const name of ["medvqa-point-shadow", "medvqa-point"]) {
        const ring = document.createElementNS(SVG, "circle");
        ring.setAttribute("class", name);
        svg.appendChild(ring);
      }
      frameOf(img).appendChild(svg);
    }
    svg.setAttribute("viewBox", `0 0 ${img.getAttribute("width")} ${img.getAttribute("height")}`);
    const box = img.getBoundingClientRect();
    svg.style.width = `${box.width}px`;
    svg.style.height = `${box.height}px`;
    const shownPerCss = Number(img.getAttribute("width")) / box.width;  // shown pixels per CSS pixel
    for (const ring of svg.querySelectorAll("circle")) {
      ring.style.display = marker ? "" : "none";
      if (!marker) continue;
      ring.setAttribute("cx", marker.x);
      ring.setAttribute("cy", marker.y);
      ring.setAttribute("r", 6 * shownPerCss);  // 6 CSS pixels whatever the zoom
    }
    for (const line of svg.querySelectorAll("line")) {
      line.style.display = ruler ? "" : "none";
      if (!ruler) continue;
      line.setAttribute("x1", ruler.x0);
      line.setAttribute("y1", ruler.y0);
      line.setAttribute("x2", ruler.x1);
      line.setAttribute("y2", ruler.y1);
    }
    if (!ruler) return;
    const [down, across, unit, note] = (img.closest("[data-measure]")?.dataset.measure || "1,1,px,").split(",");
    const size = Math.hypot((ruler.x1 - ruler.x0) * Number(across), (ruler.y1 - ruler.y0) * Number(down));
    if (length) {
      length.textContent = unit === "mm" ? `${size.toFixed(1)} mm${note ? ` ${note}` : ""}`
        : `${Math.round(size)} px (the scan gives no pixel spacing)`;
    }
  };
  const endRuler = () => {  // the line let go: kept, unless it is a click (a dot), and its length read out
    if (!ruler || !ruler.drawing) return;
    ruler.drawing = false;
    if (Math.hypot(ruler.x1 - ruler.x0, ruler.y1 - ruler.y0) < 2) ruler = null;
    drawRuler();
    document.querySelector("#medvqa-zoom output.medvqa-length")?.setAttribute("aria-busy", "false");
  };
  const useTool = (name) => {  // "measure", "probe" or null: one at a time
    measuring = name === "measure";
    probing = name === "probe";
    if (!measuring) ruler = null;
    if (!probing) marker = null;
    for (const button of document.querySelectorAll("#medvqa-zoom [data-tool]")) {
      button.setAttribute("aria-pressed", String(button.dataset.tool === name));
    }
    if (zoom.img) frameOf(zoom.img).classList.toggle("medvqa-measuring", measuring || probing);
    drawRuler();
    staleValues();
  };
  const staleValues = () => {  // a pixel's value shown only beside the mark of the click it answers
    for (const value of document.querySelectorAll("#medvqa-probe .medvqa-probe")) {
      const stale = !probing || !marker || value.dataset.for !== marker.key
        || value.dataset.click !== String(marker.click);
      if (value.hidden !== stale) value.hidden = stale;
    }
    const region = document.querySelector("#medvqa-probe");
    if (region && !region.hasAttribute("aria-live")) region.setAttribute("aria-live", "polite");
  };
  const placed = () => `${zoom.view}:${zoom.scale}:${zoom.inverted}`;
  const invert = () => {
    zoom.inverted = !zoom.inverted;
    placeZoom();
  };
  // Play: the frame slider steps on by itself, PLAY_FPS a second at most, round from the last frame to the
  // first; each step waits for the frame asked to be shown (or PLAY_WAIT_MS), so a slow answer never builds a
  // backlog. It stops with Pause (or p), the wheel over the scan, another scan, or a frame slider gone.
  const PLAY_FPS = 8, PLAY_WAIT_MS = 2000;
  let playing = null;  // {view, asked, since, timer}
  const frameRange = () => {
    const range = document.querySelector("#medvqa-frame input[type=range]");
    return range && range.offsetParent !== null && Number(range.max) > Number(range.min) ? range : null;
  };
  const showPlaying = () => {
    const button = document.querySelector("#medvqa-zoom [data-play]");
    if (!button) return;
    // (set only when changed: the page's observers see every change, and this runs from one of them)
    if (button.hidden !== !frameRange()) button.hidden = !frameRange();
    if (button.getAttribute("aria-pressed") !== String(playing !== null)) {
      button.setAttribute("aria-pressed", String(playing !== null));
    }
    if (button.textContent !== (playing ? "Pause" : "Play")) button.textContent = playing ? "Pause" : "Play";
  };
  const stopPlaying = () => {
    if (!playing) return;
    clearTimeout(playing.timer);
    playing = null;
    showPlaying();
  };
  const playStep = () => {
    const range = frameRange(), img = document.querySelector("#medvqa-scan");
    const view = img?.closest("[data-view]")?.dataset.view;
    if (!playing || !range || !img || view !== playing.view) return stopPlaying();
    const shown = Number(img.closest("[data-frame]")?.dataset.frame ?? -1) + 1;
    const waited = performance.now() - playing.since;
    if (playing.asked !== null && shown !== playing.asked && waited < PLAY_WAIT_MS) {
      playing.timer = setTimeout(playStep, 25);  // the frame asked is not shown yet
      return;
    }
    const next = Number(range.value) >= Number(range.max) ? Number(range.min) : Number(range.value) + 1;
    range.value = String(next);
    range.dispatchEvent(new Event("input", {bubbles: true}));
    Object.assign(playing, {asked: next, since: performance.now()});
    playing.timer = setTimeout(playStep, 1000 / PLAY_FPS);
  };
  const togglePlaying = () => {
    if (playing) return stopPlaying();
    const img = document.querySelector("#medvqa-scan");
    if (!frameRange() || !img) return;
    playing = {view: img.closest("[data-view]")?.dataset.view, asked: null, since: performance.now(), timer: null};
    showPlaying();
    playStep();
  };
  const zoomTo = (scale, px, py) => {  // to `scale`, the point under (px, py) of the frame staying there
    const img = zoom.img;
    if (!img) return;
    const frame = img.parentElement;
    if (px === undefined) [px, py] = [frame.clientWidth / 2, frame.clientHeight / 2];
    const box = img.getBoundingClientRect();
    const u = (frame.scrollLeft + px) / box.width, v = (frame.scrollTop + py) / box.height;
    zoom.scale = Math.min(ZOOMS[ZOOMS.length - 1], scale < 1.01 ? 1 : scale);
    const wide = wideOf(frame), high = wide * box.height / box.width;
    zoom.x = Math.min(1, Math.max(0, u + (frame.clientWidth / 2 - px) / wide));
    zoom.y = Math.min(1, Math.max(0, v + (frame.clientHeight / 2 - py) / high));
    placeZoom();
  };
  const zoomStep = (direction) => {
    const next = direction > 0 ? ZOOMS.find((z) => z > zoom.scale + 0.001)
      : [...ZOOMS].reverse().find((z) => z < zoom.scale - 0.001);
    zoomTo(next ?? zoom.scale);
  };
  document.addEventListener("click", (event) => {
    const button = event.target.closest && event.target.closest("#medvqa-zoom button");
    if (!button) return;
    if (button.dataset.tool) useTool(button.getAttribute("aria-pressed") === "true" ? null : button.dataset.tool);
    else if (button.hasAttribute("data-invert")) invert();
    else if (button.hasAttribute("data-play")) togglePlaying();
    else if (button.dataset.zoom === "fit") zoomTo(1);
    else zoomStep(button.dataset.zoom === "in" ? 1 : -1);
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && (measuring || probing) && !event.defaultPrevented
        && (event.target === document.body || event.target.closest?.("#medvqa-viewer, #medvqa-zoom"))) {
      useTool(null);
    }
    if (event.ctrlKey || event.metaKey || event.altKey || !event.target.closest
        || !event.target.closest("#medvqa-viewer .medvqa-frame, #medvqa-zoom")) return;
    const key = {"+": 1, "=": 1, "-": -1, "0": 0, "i": "invert", "I": "invert", "p": "play", "P": "play"}[event.key];
    if (key === undefined) return;
    event.preventDefault();
    if (key === "invert") invert();
    else if (key === "play") togglePlaying();
    else if (key === 0) zoomTo(1);
    else zoomStep(key);
  });
  document.addEventListener("scroll", (event) => {  // where the reader moved the zoomed scan, kept for the next slice
    const img = zoom.img;
    if (!img || event.target !== img.parentElement || !zoomed()) return;
    const frame = img.parentElement, wide = wideOf(frame);
    const high = wide * (Number(img.getAttribute("height")) || 1) / (Number(img.getAttribute("width")) || 1);
    zoom.x = (frame.scrollLeft + frame.clientWidth / 2) / wide;
    zoom.y = (frame.scrollTop + frame.clientHeight / 2) / high;
  }, true);
  // A new frame, window or scan: placed before it is drawn (an observer's callback runs before the paint).
  // Gradio may keep the viewer's elements and change their attributes to the new HTML's, which drops the
  // image's mark of having been placed.
  new MutationObserver(() => {
    const img = document.querySelector("#medvqa-scan");
    if (img !== zoom.img || (img && img.dataset.placed !== placed())) placeZoom();
    staleValues();
    showPlaying();  // the frame slider shown or hidden
  }).observe(document.body, {childList: true, subtree: true, attributes: true,
                             attributeFilter: ["src", "style", "class", "data-placed", "data-view"]});
  // The column's width changes (the window, the page's layout): the zoomed scan keeps its place.
  const resized = new ResizeObserver(() => placeZoom());
  window.addEventListener("resize", () => placeZoom());  // the window's height bounds a tall scan's
  let watched = null;
  new MutationObserver(() => {
    const viewer = document.querySelector("#medvqa-viewer");
    if (viewer && viewer !== watched) {
      if (watched) resized.unobserve(watched);
      watched = viewer;
      resized.observe(viewer);
    }
  }).observe(document.body, {childList: true, subtree: true});
  // Logged out (in another tab, or the login expired): Gradio's calls then fail without a word, so the page
  // asks whether it is still logged in when a question is asked, when the tab is shown again and every
  // minute, and says so in a banner with a way back to the login form. (Without a login the answer is yes.)
  let loggedOutShown = false;
  const checkLogin = async () => {
    if (loggedOutShown) return;
    let status = 0;
    try {
      status = (await fetch("gradio_api/login_check", {credentials: "same-origin", cache: "no-store"})).status;
    } catch (error) {
      return;  // the server unreachable: not a logout
    }
    if (status !== 401 || loggedOutShown) return;
    loggedOutShown = true;
    const banner = document.createElement("div");
    banner.id = "medvqa-logged-out";
    banner.setAttribute("role", "alert");
    banner.append("You are logged out, so questions and scans are not sent. ");
    const again = document.createElement("button");
    again.type = "button";
    again.textContent = "Log in again";
    again.addEventListener("click", () => window.location.reload());
    banner.append(again);
    document.body.prepend(banner);
  };
  document.addEventListener("click", (event) => {
    if (event.target.closest && event.target.closest("#medvqa-ask, #medvqa-upload, #medvqa-new")) checkLogin();
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && event.target.closest && event.target.closest("#medvqa-question")) checkLogin();
  });
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") checkLogin();
  });
  setInterval(checkLogin, 60000);
  document.addEventListener("click", (event) => {
    if (event.target.closest && event.target.closest(".medvqa-skip")) {
      event.preventDefault();
      document.querySelector("#medvqa-question textarea")?.focus();
    }
  });
  // Gradio's chat is a polite live region, so a screen reader reads a streamed answer token by token, and
  // it names each message by its raw HTML. The chat is kept quiet and unnamed here; each finished answer
  // (its sources, an error, a note of the app's, or "(stopped)"), less its list of sources, is read once from a
  // region of its own.
  const announcer = document.createElement("div");
  announcer.id = "medvqa-announce";
  announcer.className = "medvqa-sr-only";
  announcer.setAttribute("aria-live", "polite");
  document.body.appendChild(announcer);
  // Answers are read in order as they finish; `readUpTo` counts the leading ones read (a finished answer
  // stays as it is, so each pass looks only at the rest), `readBeyond` the later ones already read (an error
  // shown while an answer before it still streams is read at once). A chat replaced (a new scan's note, an
  // error with no scan open) shows in the last answer read having changed: reading starts over.
  let readUpTo = 0, lastRead = null, restoring = null;
  const readBeyond = new Set();
  document.addEventListener("click", (event) => {  // Restore: the conversation it brings is not read out whole
    if (event.target.closest && event.target.closest("#medvqa-restore")) {
      restoring = document.querySelectorAll("#medvqa-chat .message-row.bot-row").length;
    }
  });
  const mark = (row) => [row, row.textContent.length];
  const speak = () => {
    const chat = document.querySelector("#medvqa-chat");
    if (!chat) return;
    const region = chat.querySelector("[role=log]");
    if (region && region.getAttribute("aria-live") !== "off") region.setAttribute("aria-live", "off");
    for (const named of chat.querySelectorAll(`[aria-label^="bot's message"], [aria-label^="user's message"]`)) {
      named.removeAttribute("aria-label");
    }
    const answers = chat.querySelectorAll(".message-row.bot-row");
    const last = readUpTo > 0 ? answers[readUpTo - 1] : null;
    if (readUpTo > answers.length || (last && (last !== lastRead[0] || last.textContent.length !== lastRead[1]))) {
      readUpTo = 0;  // another chat than the one read
      readBeyond.clear();
    }
    if (restoring !== null && answers.length !== restoring && [...answers].every(finished)) {
      restoring = null;  // the restored conversation: only its last answer is read
      readUpTo = answers.length - 1;
      readBeyond.clear();
      if (readUpTo > 0) lastRead = mark(answers[readUpTo - 1]);
    }
    const news = [];
    for (let i = readUpTo; i < answers.length; i++) {
      if (!readBeyond.has(i) && finished(answers[i])) {
        news.push(said(answers[i]));
        readBeyond.add(i);
      }
    }
    while (readBeyond.has(readUpTo)) {
      readBeyond.delete(readUpTo);
      lastRead = mark(answers[readUpTo]);
      readUpTo += 1;
    }
    if (news.length) announcer.textContent = news.join(" ");
  };
  const finished = (row) => row.querySelector(".medvqa-sources, .medvqa-error, .medvqa-note")
    || [...row.querySelectorAll("em")].some((mark) => mark.textContent === "(stopped)");
  const said = (row) => {  // the answer less its list of passages
    const copy = row.cloneNode(true);
    copy.querySelectorAll(".medvqa-sources:not(.medvqa-no-sources), button").forEach((el) => el.remove());
    return copy.textContent.replace(/\s+/g, " ").trim();
  };
  const settle = () => {
    hookViewer();
    speak();
    const viewer = document.querySelector("#medvqa-viewer");
    if (viewer && !viewer.hasAttribute("aria-live")) {
      viewer.setAttribute("aria-live", "polite");
      viewer.setAttribute("aria-atomic", "true");
    }
    const log = document.querySelector("#medvqa-chat .bubble-wrap");
    const rows = log ? log.querySelectorAll(".message-row") : [];
    const last = rows[rows.length - 1];
    if (!last) return;
    // Not once the reader has scrolled the chat since its last message came: they stay where they went.
    const seen = rows.length + ":" + last.textContent.length;
    const changed = seen !== shown;
    if (rows.length !== messages) scrolled = false;
    shown = seen;
    messages = rows.length;
    if (scrolled) return;
    // "Taller": with the chat's label above it and the answer's buttons below, it would not show whole.
    if (last.classList.contains("bot-row") && last.offsetHeight > log.clientHeight - 96) {
      const top = last.getBoundingClientRect().top - log.getBoundingClientRect().top + log.scrollTop;
      const target = Math.max(0, Math.round(top - 32));  // the answer's first line, clear of the chat's label
      if (Math.abs(log.scrollTop - target) > 1) log.scrollTop = target;
    } else if (changed) {
      log.scrollTop = log.scrollHeight;  // a question, or an answer that fits: the end, as Gradio scrolls
    }
  };
  let pending = null, since = 0, shown = "", messages = 0, scrolled = false;
  for (const kind of ["wheel", "touchmove", "pointerdown", "keydown"]) {
    document.addEventListener(kind, (event) => {
      if (event.target.closest && event.target.closest("#medvqa-chat")) scrolled = true;
    }, {passive: true});
  }
  const later = () => {  // after Gradio's own scroll to the end; at least every 300 ms while the chat streams
    if (pending !== null && Date.now() - since > 300) return;
    if (pending === null) since = Date.now();
    clearTimeout(pending);
    pending = setTimeout(() => {
      pending = null;
      settle();
    }, 60);
  };
  new MutationObserver(later).observe(document.body, {childList: true, subtree: true, characterData: true});
  // Gradio may scroll to the end again after the last change (a scroll, but no user input before it).
  document.addEventListener("scroll", (event) => {
    if (!scrolled && event.target.closest && event.target.closest("#medvqa-chat")) later();
  }, true);
  const accordions = () => {
    for (const button of document.querySelectorAll("button.label-wrap")) {
      const open = String(button.classList.contains("open"));
      if (button.getAttribute("aria-expanded") !== open) button.setAttribute("aria-expanded", open);
      button.querySelector(".icon")?.setAttribute("aria-hidden", "true");
    }
  };
  accordions();
  new MutationObserver(accordions).observe(document.body, {childList: true, subtree: true, attributes: true,
                                                           attributeFilter: ["class"]});
  // Gradio sets a message's aria-label again when its text changes.
  new MutationObserver(later).observe(document.body,
                                      {subtree: true, attributes: true, attributeFilter: ["aria-label"]});
  hookViewer();
  document.body.dataset.medvqa = "ready";  // for the browser tests: the handlers above are in place
}
