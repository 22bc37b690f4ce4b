"""The page's own style and script, which Gradio's components do not give: contrast in both colour schemes,
the keyboard, a screen reader's view of the chat, and the viewer's wheel, drag and tools (build_app passes them
to gr.Blocks as `css` and `js`). The script is page.js beside this file, a JavaScript file of its own so that
it reads, and can be checked, as one (`node --check medvqa/ui/page.js`)."""

from pathlib import Path


def page_script(name: str) -> str:
    """The function in the file `name` beside this one, from its line "() => {" on (the comments above it are
    the file's, not the page's)."""
    text = (Path(__file__).with_name(name)).read_text(encoding="utf-8")
    start = text.find("\n() => {")
    if start < 0:
        raise RuntimeError(f"{name} has no line '() => {{' to start the page's function")
    return text[start + 1:]


# Colours are checked against both of Gradio's schemes (it follows the system's; ".dark" on the page) and
# under the chat's own 0.8 opacity: 4.5:1 or more for text. The notice keeps its light background in both,
# so its text is set dark on every element inside it (Gradio's prose rules would give them the scheme's).
# Ask and Stop are darker than the theme's orange and red (2.8:1 and 3.8:1 with their white text).
PAGE_CSS = """
#medvqa-notice { border-left: 4px solid #d97706; background: #fffbeb; padding: 8px 12px; }
#medvqa-notice, #medvqa-notice * { color: #78350f !important; }
.medvqa-viewer { margin: 0; }
.medvqa-viewer img { display: block; width: 100%; max-width: 640px; height: auto; image-rendering: auto;
                    background: #000; }
.medvqa-frame { position: relative; width: 100%; max-width: 640px; overflow: hidden; background: #000; }
.medvqa-frame.medvqa-measuring, .medvqa-frame.medvqa-measuring img { cursor: crosshair; touch-action: none; }
.medvqa-overlay { position: absolute; left: 0; top: 0; pointer-events: none; }
.medvqa-overlay line { stroke-linecap: round; vector-effect: non-scaling-stroke; }
.medvqa-overlay .medvqa-ruler { stroke: #facc15; stroke-width: 2; }
.medvqa-overlay .medvqa-ruler-shadow { stroke: #000; stroke-width: 4; }
.medvqa-overlay circle { fill: none; vector-effect: non-scaling-stroke; }
.medvqa-overlay .medvqa-point { stroke: #22d3ee; stroke-width: 2; }
.medvqa-overlay .medvqa-point-shadow { stroke: #000; stroke-width: 4; }
#medvqa-probe { font-size: 0.9em; font-weight: 600; min-height: 0; margin-top: calc(-1 * var(--layout-gap, 12px)); }
#medvqa-zoom output.medvqa-length:empty { min-width: 0; }
#medvqa-zoom [aria-pressed=true] { background: #1d4ed8; border-color: #1d4ed8; color: #fff; }
.medvqa-frame.medvqa-zoomed { overflow: auto; cursor: grab; }
#medvqa-scan.medvqa-inverted { filter: invert(1); }
#medvqa-logged-out { position: sticky; top: 0; z-index: 1000; padding: 10px 14px; background: #991b1b;
  color: #fff; font-weight: 600; }
#medvqa-logged-out button { margin-left: 8px; padding: 2px 10px; border-radius: 4px; background: #fff;
  color: #991b1b; font-weight: 600; }
.medvqa-frame.medvqa-panning { cursor: grabbing; }
.medvqa-frame:focus-visible { outline: 2px solid #2563eb; outline-offset: 2px; }
#medvqa-zoom-bar { margin-top: calc(-1 * var(--layout-gap, 12px) + 4px); }
#medvqa-zoom { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 0; }
#medvqa-zoom .medvqa-length { font-size: 0.9em; font-weight: 600; }
#medvqa-zoom[hidden] { display: none; }
#medvqa-zoom button { min-width: 2.4em; padding: 2px 8px; border: 1px solid #6b7280; border-radius: 4px;
                      background: transparent; color: inherit; cursor: pointer; font: inherit; line-height: 1.6; }
#medvqa-zoom button:disabled { opacity: 0.5; cursor: default; }
#medvqa-zoom button:focus-visible { outline: 2px solid #2563eb; outline-offset: 2px; }
#medvqa-zoom output { min-width: 3.5em; text-align: center; font-size: 0.9em; }
#medvqa-zoom .medvqa-hint { font-size: 0.85em; color: #52525b; }
.dark #medvqa-zoom .medvqa-hint { color: #d4d4d8; }
.medvqa-caption { font-size: 0.85em; opacity: 0.8; margin-top: 4px; }
.medvqa-warning { font-size: 0.9em; margin: 6px 0 0 0; padding: 4px 8px; border-left: 4px solid #b45309;
  background: #fffbeb; color: #78350f; }
.dark .medvqa-warning { background: #451a03; color: #fde68a; }
.medvqa-sources { margin-top: 0.6em; font-size: 0.92em; border-top: 1px solid #ccc; padding-top: 0.4em; }
.medvqa-sources ol { margin: 0.2em 0 0 0; padding: 0; list-style: none; }
.medvqa-error { color: #991b1b; }
.dark .medvqa-error { color: #fca5a5; }
.medvqa-withheld { border-left: 4px solid #6b7280; padding: 0 0 0 8px; }
.medvqa-uncertain { font-style: italic; }
.medvqa-mark { display: inline-block; vertical-align: top; font-size: 0.9em; }
.medvqa-mark summary { cursor: pointer; }
.medvqa-contradicts summary { color: #92400e; }
.dark .medvqa-contradicts summary { color: #fcd34d; }
.medvqa-injection { border-left: 4px solid #b91c1c; background: #fef2f2; color: #7f1d1d; padding: 6px 10px; }
#medvqa-frame input[type=range]:focus-visible, #medvqa-center input[type=range]:focus-visible,
#medvqa-width input[type=range]:focus-visible { outline: 2px solid #2563eb; outline-offset: 2px; }
.medvqa-sr-only { position: absolute; width: 1px; height: 1px; overflow: hidden; clip-path: inset(50%); margin: 0; }
#medvqa-question .info-text { color: #52525b; }
.dark #medvqa-question .info-text { color: #d4d4d8; }
.medvqa-out-of-flow { position: absolute !important; z-index: 10; }
.medvqa-skip { position: absolute; left: -10000px; }
.medvqa-skip:focus { position: static; background: #fff; color: #1d4ed8; padding: 4px 8px; }
#medvqa-ask, #medvqa-stop { color: #fff !important; }
#medvqa-ask { background: #c2410c !important; border-color: #c2410c !important; }
#medvqa-ask:hover { background: #9a3412 !important; border-color: #9a3412 !important; }
#medvqa-stop { background: #b91c1c !important; border-color: #b91c1c !important; }
#medvqa-stop:hover { background: #991b1b !important; border-color: #991b1b !important; }
"""

# The viewer's zoom, measuring and pixel-value buttons (their handlers are in PAGE_JS; shown once there is a scan).
ZOOM_TOOLBAR = (
    '<div id="medvqa-zoom" role="group" aria-label="Zoom, invert, measure and pixel value (for the eye only: the '
    'model sees the whole scan as it is)" hidden>'
    '<button type="button" data-zoom="out" aria-label="Zoom out" title="Zoom out (−)">−</button>'
    '<output class="medvqa-level" aria-live="polite" aria-label="Zoom level">100 %</output>'
    '<button type="button" data-zoom="in" aria-label="Zoom in" title="Zoom in (+)">+</button>'
    '<button type="button" data-zoom="fit" title="Whole scan (0)">Fit</button>'
    '<button type="button" data-invert aria-pressed="false" '
    'title="Invert the grey levels, for the eye only (i)">Invert</button>'
    '<button type="button" data-play aria-pressed="false" hidden '
    'title="Play the frames or slices in turn, from the one shown, and round again (p)">Play</button>'
    '<button type="button" data-tool="measure" aria-pressed="false" '
    'title="Measure a distance: drag across the scan (Esc ends)">Measure</button>'
    '<output class="medvqa-length" aria-live="polite" aria-label="Length measured"></output>'
    '<button type="button" data-tool="probe" aria-pressed="false" '
    'title="Pixel value: click a point of the scan (Esc ends)">Value</button>'
    '<span class="medvqa-hint">Ctrl+wheel zooms at the pointer; Shift+drag moves a zoomed scan; i inverts; '
    'p plays the frames.</span></div>')

PAGE_JS = page_script("page.js")
