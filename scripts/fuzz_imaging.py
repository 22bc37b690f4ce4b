"""Fuzz medvqa.imaging with mutated real DICOM, PNG, JPEG and TIFF files.

    python scripts/fuzz_imaging.py --cases 10000
    cases=10000 crashes=0 hangs=0

Every case must either render or raise ScanError. A crash is any other exception, a wrong
output, or a worker process that died (segfault, out of memory); a hang is a case slower than
--hang-seconds. Cases run in a child process, so a crash or an endless loop inside a C decoder
costs one case, not the run. Case k is the same bytes on every run with the same --seed.

The seed corpus and the mutations are importable, so tests/test_imaging_fuzz.py runs a fixed
number of them under hypothesis in CI. Nothing is written to disk unless --save-dir is given.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import random
import resource
import sys
import time
import zlib
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT.parent / "shared" / "data"

from medvqa.imaging import ScanError, open_scan

# Small real files bundled with pydicom, one per decoder path (native LE/BE, deflate, RLE, JPEG
# baseline/extended, JPEG-LS, JPEG 2000, palette, YBR, multi-frame, 1-bit), small enough that a
# case takes milliseconds.
PYDICOM_SEEDS = (
    "CT_small.dcm", "MR_small_bigendian.dcm", "MR_small_RLE.dcm", "MR_small_jp2klossless.dcm",
    "MR_small_jpeg_ls_lossless.dcm", "JPGExtended.dcm", "SC_rgb_jpeg_dcmtk.dcm",
    "SC_rgb_dcmtk_+eb+cy+np.dcm", "SC_rgb_rle_2frame.dcm", "SC_ybr_full_422_uncompressed.dcm",
    "examples_palette.dcm", "image_dfl.dcm", "rtdose.dcm", "liver_1frame.dcm", "693_J2KI.dcm",
)

# Values that break length fields, sizes and bit depths.
INTERESTING = (0, 1, 2, 3, 7, 8, 12, 15, 16, 17, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096,
               32767, 32768, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1)

# Byte patterns whose neighbourhood holds sizes and lengths: DICOM pixel-module tags (little
# endian), item tags, JPEG / JPEG 2000 markers, PNG chunk names.
HOT_PATTERNS = (
    b"\x28\x00\x10\x00", b"\x28\x00\x11\x00", b"\x28\x00\x08\x00", b"\x28\x00\x02\x00",
    b"\x28\x00\x04\x00", b"\x28\x00\x00\x01", b"\x28\x00\x01\x01", b"\x28\x00\x03\x01",
    b"\x28\x00\x06\x00", b"\x28\x00\x50\x10", b"\x28\x00\x51\x10", b"\x28\x00\x52\x10",
    b"\x28\x00\x53\x10", b"\x02\x00\x10\x00", b"\xe0\x7f\x10\x00", b"\xfe\xff\x00\xe0",
    b"\x28\x00\x01\x11", b"\x28\x00\x01\x12",
    b"\xff\xc0", b"\xff\xc1", b"\xff\xc3", b"\xff\xc4", b"\xff\xda", b"\xff\xdb", b"\xff\xf7",
    b"\xff\x51", b"\xff\x52", b"\xff\x90",
    b"IHDR", b"PLTE", b"tRNS", b"IDAT",
)

EDIT_KINDS = ("flip", "byte", "word", "hot", "insert", "delete", "truncate", "duplicate")


# ── Seed corpus ──────────────────────────────────────────────────────────────────────────────

def seed_corpus() -> list[tuple[str, bytes]]:
    """(name, bytes) of every seed, in a fixed order."""
    from pydicom.data import get_testdata_file

    seeds = []
    for name in PYDICOM_SEEDS:
        path = get_testdata_file(name, download=False)
        if path is not None:
            seeds.append((name, Path(path).read_bytes()))
    seeds += _synthetic_dicoms()
    seeds += _pictures(_real_picture())
    return seeds


def _real_picture() -> np.ndarray:
    """A real radiograph from VQA-RAD (downscaled so a case stays fast), or a synthetic one."""
    from PIL import Image

    images = sorted((DATA_DIR / "vqa_rad" / "images").glob("synpic*.jpg"))
    if images:
        with Image.open(images[0]) as image:
            return np.asarray(image.convert("L").resize((96, 96)))
    y, x = np.mgrid[0:96, 0:96]
    return ((x * 2 + y) % 256).astype(np.uint8)


def _pictures(gray: np.ndarray) -> list[tuple[str, bytes]]:
    from PIL import Image

    def encode(image: Image.Image, fmt: str, **options) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, fmt, **options)
        return buffer.getvalue()

    gray16 = Image.fromarray(gray.astype(np.uint16) * 200)  # mode I;16
    rgb = Image.fromarray(np.stack([gray, gray[::-1], 255 - gray], axis=-1))
    rgba = rgb.convert("RGBA")
    rgba.putalpha(Image.fromarray(gray))
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pages = [Image.fromarray(gray.astype(np.uint16) * k) for k in (50, 100)]
    tiff_pages = io.BytesIO()
    pages[0].save(tiff_pages, "TIFF", save_all=True, append_images=pages[1:])
    return [
        ("gray8.png", encode(Image.fromarray(gray), "PNG")),
        ("gray16.png", encode(gray16, "PNG")),
        ("rgba.png", encode(rgba, "PNG")),
        ("palette.png", encode(palette, "PNG", transparency=0)),
        ("gray_alpha.png", encode(Image.fromarray(gray).convert("LA"), "PNG")),
        ("rgb.jpg", encode(rgb, "JPEG", quality=90)),
        ("gray.jpg", encode(Image.fromarray(gray), "JPEG", progressive=True)),
        ("gray16_pages.tif", tiff_pages.getvalue()),
        ("rgb_deflate.tif", encode(rgb, "TIFF", compression="tiff_adobe_deflate")),
    ]


def _synthetic_dicoms() -> list[tuple[str, bytes]]:
    """Paths the bundled files do not cover: MONOCHROME1 with a VOI LUT, and an enhanced
    multi-frame CT with rescale and window in its functional groups."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    def finish(ds: Dataset, sop_class: str) -> bytes:
        ds.SOPClassUID, ds.SOPInstanceUID = sop_class, generate_uid(entropy_srcs=["fuzz", sop_class])
        ds.file_meta = FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.file_meta.MediaStorageSOPClassUID = sop_class
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        buffer = io.BytesIO()
        ds.save_as(buffer, enforce_file_format=True)
        return buffer.getvalue()

    def pixel_module(ds: Dataset, pixels: np.ndarray, photometric: str) -> None:
        ds.Rows, ds.Columns = pixels.shape[-2:]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
        ds.PixelData = pixels.astype("<u2").tobytes()

    y, x = np.mgrid[0:32, 0:32]
    cr = Dataset()
    cr.Modality = "CR"
    pixel_module(cr, (x * 64 + y) % 4096, "MONOCHROME1")
    lut = Dataset()
    lut.add_new("LUTDescriptor", "US", [4096, 0, 12])
    lut.add_new("LUTData", "US", [min(4095, v * 2) for v in range(4096)])
    cr.VOILUTSequence = [lut]

    ct = Dataset()
    ct.Modality = "CT"
    pixel_module(ct, np.stack([(x * 40 + y * k) % 4096 for k in range(1, 4)]), "MONOCHROME2")
    ct.NumberOfFrames = 3
    shared = Dataset()
    transform = Dataset()
    transform.RescaleSlope, transform.RescaleIntercept, transform.RescaleType = 1, -1024, "HU"
    shared.PixelValueTransformationSequence = [transform]
    ct.SharedFunctionalGroupsSequence = [shared]
    per_frame = []
    for center in (40, 400, -600):
        group, voi = Dataset(), Dataset()
        voi.WindowCenter, voi.WindowWidth = center, 400
        group.FrameVOILUTSequence = [voi]
        per_frame.append(group)
    ct.PerFrameFunctionalGroupsSequence = per_frame
    return [("cr_voi_lut.dcm", finish(cr, "1.2.840.10008.5.1.4.1.1.1")),
            ("enhanced_ct.dcm", finish(ct, "1.2.840.10008.5.1.4.1.1.2.1"))]


# ── Mutations ────────────────────────────────────────────────────────────────────────────────

def random_edits(rng: random.Random) -> list[tuple[str, float, int]]:
    """Mostly one or two edits, mostly in place, so that many cases still get past the header
    and into a decoder; half of the positions lean towards the start, where the headers are."""
    edits = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 6))):
        where = rng.random() ** 3 if rng.random() < 0.5 else rng.random()
        kind = rng.choices(EDIT_KINDS, weights=(3, 3, 3, 4, 1, 1, 1, 1))[0]
        edits.append((kind, where, rng.randrange(2**16)))
    return edits


def apply_edits(data: bytes, edits: list[tuple[str, float, int]]) -> bytes:
    """Apply (kind, where in [0, 1), value) edits. A mutated PNG gets its chunk CRCs recomputed,
    so that mutations reach the decoder instead of stopping at the checksum."""
    buffer = bytearray(data)
    hotspots = [i for pattern in HOT_PATTERNS for i in _find_all(data, pattern)] or [0]
    for kind, where, value in edits:
        if not buffer:
            break
        position = min(int(where * len(buffer)), len(buffer) - 1)
        if kind == "flip":
            buffer[position] ^= 1 << (value % 8)
        elif kind == "byte":
            buffer[position] = value & 0xFF
        elif kind in ("word", "hot"):
            if kind == "hot":  # a size or length just after a tag, marker or chunk name
                position = min(hotspots[int(where * len(hotspots))] + 2 + (value >> 8) % 12, len(buffer) - 1)
            number = INTERESTING[value % len(INTERESTING)]
            width = 2 if number < 65536 and value & 0x80 else 4
            order = "big" if value & 0x40 else "little"
            encoded = (number % 2 ** (8 * width)).to_bytes(width, order)
            buffer[position:position + width] = encoded
        elif kind == "insert":
            buffer[position:position] = bytes([value & 0xFF]) * (1 + (value >> 8) % 64)
        elif kind == "delete":
            del buffer[position:position + 1 + (value >> 8) % 64]
        elif kind == "truncate":
            del buffer[max(position, 1):]
        elif kind == "duplicate":  # repeat a block, e.g. a marker segment or an item
            block = buffer[position:position + 1 + (value >> 4) % 256]
            buffer[position:position] = block
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        _fix_png_crcs(buffer)
    return bytes(buffer)


def _find_all(data: bytes, pattern: bytes, limit: int = 65536) -> list[int]:
    found, start = [], data.find(pattern, 0, limit)
    while start >= 0 and len(found) < 64:
        found.append(start)
        start = data.find(pattern, start + 1, limit)
    return found


def _fix_png_crcs(buffer: bytearray) -> None:
    position = 8
    while position + 12 <= len(buffer):
        length = int.from_bytes(buffer[position:position + 4], "big")
        end = position + 8 + length
        if end + 4 > len(buffer):
            return
        buffer[end:end + 4] = zlib.crc32(buffer[position + 4:end]).to_bytes(4, "big")
        position = end + 4


# ── One case ─────────────────────────────────────────────────────────────────────────────────

def run_case(data: bytes) -> str:
    """"ok", "refused" (ScanError) or "crash: <what>"."""
    try:
        source = open_scan(data)
        scans = [source.render(), source.render(window="lung", frame=source.frame_count - 1)]
    except ScanError:
        return "refused"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - this is what the fuzzer is looking for
        return f"crash: {type(error).__name__}: {error}"[:300]
    for scan in scans:
        if scan.pixels.dtype != np.uint8 or scan.pixels.ndim != 3 or scan.pixels.shape[2] != 3:
            return f"crash: bad output {scan.pixels.dtype} {scan.pixels.shape}"
    return "ok"


def case_bytes(corpus: list[tuple[str, bytes]], seed: int, case: int) -> tuple[str, bytes]:
    rng = random.Random(f"{seed}:{case}")
    name, data = corpus[rng.randrange(len(corpus))]
    return name, apply_edits(data, random_edits(rng))


# ── Runner ───────────────────────────────────────────────────────────────────────────────────

def _worker(connection, first_case: int, cases: int, seed: int, memory_mb: int) -> None:
    # An address-space cap turns a runaway allocation into MemoryError instead of an OOM kill.
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    corpus = seed_corpus()
    for case in range(first_case, cases):
        name, data = case_bytes(corpus, seed, case)
        connection.send(("start", case, name))
        started = time.perf_counter()
        outcome = run_case(data)
        connection.send(("done", case, outcome, time.perf_counter() - started))
    connection.close()


def fuzz(cases: int, seed: int = 0, hang_seconds: float = 2.0, memory_mb: int = 4096,
         save_dir: Path | None = None) -> tuple[int, int]:
    context = multiprocessing.get_context("fork")
    kill_after = max(10.0, 5 * hang_seconds)  # a case still running then is stopped
    crashes = hangs = 0
    next_case = 0

    def report(case: int, name: str, what: str) -> None:
        print(f"case {case} ({name}): {what}", file=sys.stderr)
        if save_dir is not None:
            save_dir.mkdir(parents=True, exist_ok=True)
            (save_dir / f"case{case}_{name}").write_bytes(case_bytes(seed_corpus(), seed, case)[1])

    while next_case < cases:
        receiver, sender = context.Pipe(duplex=False)
        worker = context.Process(target=_worker, args=(sender, next_case, cases, seed, memory_mb), daemon=True)
        worker.start()
        sender.close()
        running: tuple[int, str] | None = None  # the case started and not yet done
        while next_case < cases:
            # Before the first case the worker builds the corpus, which takes a moment.
            if not receiver.poll(kill_after if running else 120):
                worker.kill()
                case, name = running or (next_case, "?")
                hangs += 1
                report(case, name, f"hang (killed after {kill_after:.0f} s)")
                next_case = case + 1
                break
            try:
                message = receiver.recv()
            except EOFError:  # the worker died: segfault, abort or out of memory
                worker.join(5)
                case, name = running or (next_case, "?")
                crashes += 1
                report(case, name, f"worker died (exit code {worker.exitcode})")
                next_case = case + 1
                break
            if message[0] == "start":
                running = message[1:]
                continue
            _, case, outcome, elapsed = message
            if outcome.startswith("crash"):
                crashes += 1
                report(case, running[1], outcome)
            elif elapsed > hang_seconds:
                hangs += 1
                report(case, running[1], f"hang ({elapsed:.1f} s, {outcome})")
            if (case + 1) % 1000 == 0:
                print(f"... {case + 1} cases, {crashes} crashes, {hangs} hangs", file=sys.stderr)
            running, next_case = None, case + 1
        worker.join(5)
        receiver.close()
    return crashes, hangs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hang-seconds", type=float, default=2.0, help="a slower case counts as a hang")
    parser.add_argument("--memory-mb", type=int, default=4096, help="address-space cap of the worker")
    parser.add_argument("--save-dir", type=Path, default=None, help="write crashing inputs here (off by default)")
    args = parser.parse_args()
    crashes, hangs = fuzz(args.cases, args.seed, args.hang_seconds, args.memory_mb, args.save_dir)
    print(f"cases={args.cases} crashes={crashes} hangs={hangs}")
    sys.exit(1 if crashes or hangs else 0)


if __name__ == "__main__":
    main()
