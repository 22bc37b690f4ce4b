"""A study, not a file: uploaded files grouped into series, slices in the order a viewer shows them.

    open_study(files | folder | .zip) ─▶ Study(series: [Series], notes)
                                              │ Series.render(window, slice)  (the ScanSource interface)
                                              ▼
                                             Scan(pixels, window, frame_index = slice, series, position_mm)

Single-frame DICOM files are grouped by series (their SeriesInstanceUID, compared here and never
kept) and ordered by position along the slice normal: ImagePositionPatient · (row × column
direction of ImageOrientationPatient). Without positions, or when the slices lie in different
planes, they fall back to InstanceNumber, and the series says so; gaps and duplicate positions are
said too. A multi-frame file is a series of its own, its frames the slices. Objects without an
image (reports, presentation states), damaged and non-DICOM files, and copies of a file already in
the upload (the same bytes, or the same SOP Instance UID and pixel data) are skipped with a note;
files from several studies (StudyInstanceUID, compared like the series') get a note that says how
many. Each file goes through the same opener, and so the same allow-list, as a single upload.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .archive import _read_files
from .dicom import _NoImage, _open_dicom_placed, _Placement
from .guard import ScanError, _run_public
from .picture import _open_picture
from .scan import MIN_SIDE, Scan, ScanLimits, ScanSource, _check_frame, _TooSmall, burned_in
from .upload import _sniff_format
from .windowing import Window

_SAME_MM = 0.01  # positions closer than this are the same position
_SAME_DIRECTION = 1e-3  # direction cosines closer than this are the same orientation
# Fields a slice gives of itself rather than the series' middle slice: its size and the spacing of its
# pixels, so that a measurement on it (the page's ruler) is its own.
_OWN_PER_SLICE = ("Rows", "Columns", "PixelSpacing", "ImagerPixelSpacing", "BurnedInAnnotation")
_GAP_FACTOR = 1.5  # a spacing this much wider than the usual one is a gap
_COPY = "a duplicate of another file in the upload"


@dataclass
class _Slice:
    source: ScanSource
    frame: int
    placement: _Placement | None
    order: int  # the file's place in the upload, the last tie-breaker


class Series:
    """The slices of one series in display order. Offers ScanSource's interface (render, frame_count,
    default_frame, default_window, value_range, safe_meta), a frame being a slice."""

    def __init__(self, number: int, slices: list[_Slice], positions_mm: list[float | None], warnings: list[str]):
        self.number = number  # 1, 2, ... in the order the study lists them: never a UID
        self._slices = slices
        self.positions_mm = positions_mm
        self.warnings = warnings
        middle = slices[len(slices) // 2].source
        self.source_format = middle.source_format
        self.is_dicom = middle.is_dicom
        self.safe_meta = dict(middle.safe_meta)
        self.modality = self.safe_meta.get("Modality", "")
        self.frame_count = len(slices)
        self.default_frame = len(slices) // 2
        self.default_window = middle.default_window  # one window for the whole series while scrolling
        self.value_range = middle.value_range
        self._shown: ScanSource | None = None

    def render(self, window: Window | str | None = None, frame: int | None = None) -> Scan:
        """Slice `frame` (0-based, display order; None for the middle one) through `window`, as
        ScanSource.render takes it. With no window asked, a slice's own window from its file is used,
        else the series' automatic one, so that scrolling does not change the brightness."""
        index = self.default_frame if frame is None else _run_public(self._check_slice, frame)
        chosen = self._slices[index]
        if window is None and self.default_window is not None and self.default_window.name == "auto-percentile":
            window = self.default_window
        scan = chosen.source.render(window=window, frame=chosen.frame)
        if self._shown is not None and self._shown is not chosen.source:
            self._shown.forget_decoded()  # only the slice on screen stays decoded
        self._shown = chosen.source
        meta = dict(self.safe_meta)
        for keyword in _OWN_PER_SLICE:  # the slice's own (a localiser or another field of view may differ)
            meta.pop(keyword, None)
            if keyword in scan.safe_meta:
                meta[keyword] = scan.safe_meta[keyword]
        return dataclasses.replace(scan, frame_index=index, frame_count=self.frame_count, series=self.number,
                                   position_mm=self.positions_mm[index], safe_meta=meta)

    def value_at(self, frame: int, row: int, column: int) -> float | tuple[int, ...]:
        """One pixel's value of slice `frame` (display order), as ScanSource.value_at gives it."""
        chosen = self._slices[_run_public(self._check_slice, frame)]
        value = chosen.source.value_at(chosen.frame, row, column)
        if chosen.source is not self._shown:
            chosen.source.forget_decoded()  # only the slice on screen stays decoded (it alone is counted)
        return value

    @property
    def decoded_bytes(self) -> int:
        """Bytes of decoded pixels kept (the slice on screen's)."""
        return self._shown.decoded_bytes if self._shown is not None else 0

    def forget_decoded(self) -> None:
        """Drop the decoded slice kept for re-windowing; it is decoded again when next shown."""
        if self._shown is not None:
            self._shown.forget_decoded()

    def _check_slice(self, frame: int) -> int:
        try:
            return _check_frame(frame, self.frame_count)
        except ScanError:
            count = self.frame_count
            shown = f" {frame + 1}" if isinstance(frame, int) else ""
            raise ScanError(f"Slice{shown} was requested, but this series has {count} slice{'s' if count > 1 else ''} "
                            f"(1 to {count}).") from None

    @property
    def burned_in_slices(self) -> int:
        """How many slices' files say text is burned into their pixels (scan.burned_in)."""
        return sum(burned_in(s.source.safe_meta) for s in self._slices)

    def summary(self) -> dict:
        """What `medvqa scan --json` prints for the series."""
        return {"modality": self.modality, "slices": self.frame_count, "positions_mm": self.positions_mm,
                "warnings": list(self.warnings), "burned_in_slices": self.burned_in_slices}

    def describe(self) -> str:
        """A label for a series picker, from allow-listed fields only."""
        return f"Series {self.number}: {self.modality or self.source_format.upper()}, {self.frame_count} " \
               f"slice{'s' if self.frame_count != 1 else ''}"

    def __repr__(self) -> str:
        return f"Series({self.number}, {self.modality}, slices={self.frame_count}, warnings={self.warnings})"


@dataclass
class Study:
    series: list[Series]  # the largest first
    notes: list[str]  # files from several studies, files skipped and why, in words: never a file name or UID
    # keyed digests of the patient IDs its files name (dicom._patient_key), never the IDs: compared only
    patients: frozenset[bytes] = field(default=frozenset(), repr=False)


def open_study(data: bytes | str | os.PathLike | Sequence[bytes | str | os.PathLike],
               limits: ScanLimits | None = None) -> Study:
    """Open one upload or several: a file, a folder, a .zip, or a list of any of these. Raises
    ScanError (with a message for the clinician) when nothing in it can be shown."""
    items = list(data) if isinstance(data, (list, tuple)) else [data]
    return _run_public(_open_study, items, limits or ScanLimits())


def _open_study(items: list, limits: ScanLimits) -> Study:
    files = _read_files(items, limits)
    if not files:
        raise ScanError("The upload holds no files.")
    if len(files) == 1 and _sniff_format(files[0]) != "dicom":  # a picture (or a clear refusal of the file)
        source = _open_picture(files[0], _sniff_format(files[0]), limits)
        return Study([_series_of_frames(1, source)], [])
    groups: dict[str, list[_Slice]] = {}
    single: list[_Slice] = []  # multi-frame files: a series each
    skipped: Counter[str] = Counter()
    files_seen: set[bytes] = set()  # a file selected twice is not decoded twice
    copies_seen: set[bytes] = set()
    for order, raw in enumerate(files):
        if len(files) == 1:  # one file: its own message, as a single upload gets
            source, placement = _open_dicom_placed(raw, limits)
        else:
            try:
                if raw[128:132] != b"DICM":
                    skipped["not a DICOM file"] += 1
                    continue
                if raw in files_seen:
                    skipped[_COPY] += 1
                    continue
                files_seen.add(raw)
                source, placement = _open_dicom_placed(raw, limits)
            except _NoImage as error:
                skipped[f"{error.what} (no image)"] += 1
                continue
            except _TooSmall:
                skipped[f"an image under {MIN_SIDE} pixels a side, too small to read"] += 1
                continue
            except ScanError:
                skipped["a DICOM file that could not be read"] += 1
                continue
        source.forget_decoded()
        if placement.copy_key is not None:
            if placement.copy_key in copies_seen:  # the same image again, perhaps with other tags
                skipped[_COPY] += 1
                continue
            copies_seen.add(placement.copy_key)
        if source.frame_count > 1:
            single.append(_Slice(source, 0, placement, order))
        else:
            groups.setdefault(placement.series_key, []).append(_Slice(source, 0, placement, order))
    notes = [f"Skipped {count} file{'s' if count > 1 else ''}: {what}." for what, count in sorted(skipped.items())]
    if not groups and not single:
        raise ScanError(f"None of the {len(files)} file{'s' if len(files) > 1 else ''} in this upload is a DICOM "
                        f"image. {' '.join(notes)}")
    kept = single + [s for members in groups.values() for s in members]
    studies = len({s.placement.study_key for s in kept} - {""})
    patients = frozenset(s.placement.patient_key for s in kept) - {None}
    if len(patients) > 1:  # counted, never named
        notes.insert(0, f"These files name {len(patients)} different patients (their patient IDs differ)"
                        f"{f', in {studies} studies' if studies > 1 else ''}: check that they belong together.")
    elif studies > 1:  # counted, never named: a UID identifies the study
        notes.insert(0, f"These files come from {studies} different studies, so perhaps from different patients: "
                        "check that they belong together.")
    ordered = [_with_size_warning(*_ordered(members)) for members in groups.values()]
    ordered += [_frames_ordered(s) for s in single]
    ordered.sort(key=lambda group: (-len(group[0]), min(s.order for s in group[0])))
    return Study([Series(number, *group) for number, group in enumerate(ordered, start=1)], notes, patients)


def _series_of_frames(number: int, source: ScanSource) -> Series:
    count = source.frame_count
    return Series(number, [_Slice(source, frame, None, 0) for frame in range(count)], [None] * count, [])


def _frames_ordered(file: _Slice) -> tuple[list[_Slice], list[float | None], list[str]]:
    """A multi-frame file's frames in display order, as `_ordered` gives a series' slices. An enhanced
    file's frames are ordered along the slice normal by their own positions (they may be stored in any
    order, PS3.3 C.7.6.16.2.2). Frames that do not make one stack keep their stored order, which is then
    their order in time, without a warning: frames without positions (an older multi-frame), or frames
    sharing a position (a cine loop, a series of time points over the same slices)."""
    count = file.source.frame_count
    stored = [_Slice(file.source, frame, None, frame) for frame in range(count)]
    planes = file.placement.frames if file.placement is not None else None
    if planes is None or len(planes) != count or any(None in plane for plane in planes):
        return stored, [None] * count, []
    frames = [_Slice(file.source, frame, dataclasses.replace(file.placement, orientation=orientation,
                                                             position=position, instance_number=None, frames=None),
                     frame) for frame, (orientation, position) in enumerate(planes)]
    orientations = _distinct_orientations(frames)
    if len(orientations) > 1:
        return stored, [None] * count, [
            f"The frames of this file lie in {len(orientations)} different orientations, so they cannot be "
            "ordered by position: they are shown in the order the file stores them, and it may not be a stack."]
    positions = [_position_along_normal(f.placement) for f in frames]
    if None in positions or min(np.diff(sorted(positions)), default=_SAME_MM) < _SAME_MM:
        return stored, [None] * count, []
    order = sorted(range(count), key=lambda i: (positions[i], i))
    frames = [dataclasses.replace(frames[i], placement=None) for i in order]
    positions = [round(positions[i], 2) for i in order]
    return frames, positions, _spacing_warnings(positions)


def _ordered(members: list[_Slice]) -> tuple[list[_Slice], list[float | None], list[str]]:
    """The slices in display order, their positions along the normal (mm) and what is odd about them."""
    by_instance = sorted(members, key=lambda s: (s.placement.instance_number is None,
                                                 s.placement.instance_number or 0, s.order))
    if len(members) == 1:
        return members, [_position_along_normal(members[0].placement)], []
    orientations = _distinct_orientations(members)
    if len(orientations) > 1:
        return by_instance, [None] * len(members), [
            f"The slices of this series lie in {len(orientations)} different orientations, so they cannot be "
            "ordered by position: they are shown in instance-number order, and it may not be a stack."]
    positions = [_position_along_normal(s.placement) for s in members]
    if None in positions:
        return by_instance, [None] * len(members), [
            "Some slices do not say where they lie (no position or orientation): they are shown in "
            "instance-number order."]
    order = sorted(range(len(members)), key=lambda i: (positions[i], by_instance.index(members[i])))
    slices, positions = [members[i] for i in order], [round(positions[i], 2) for i in order]
    return slices, positions, _spacing_warnings(positions)


def _with_size_warning(slices: list[_Slice], positions: list[float | None],
                       warnings: list[str]) -> tuple[list[_Slice], list[float | None], list[str]]:
    """`_ordered`'s result, with a word when its slices are not all one size (a localiser filed with the
    stack, or another field of view): scrolling then jumps in scale."""
    sizes = Counter((s.source.safe_meta.get("Columns"), s.source.safe_meta.get("Rows")) for s in slices)
    if len(sizes) > 1:
        (columns, rows), usual = sizes.most_common(1)[0]
        other = len(slices) - usual
        differ = "differs" if other == 1 else "differ"
        warnings = [*warnings, f"{other} of the {len(slices)} slices {differ} in size from the rest ({columns}×{rows} "
                               "pixels): perhaps a localiser or another field of view; each is shown at its own size."]
    return slices, positions, warnings


def _distinct_orientations(members: list[_Slice]) -> list[tuple[float, ...]]:
    distinct: list[tuple[float, ...]] = []
    for s in members:
        orientation = s.placement.orientation
        if orientation is not None and not any(
                max(abs(a - b) for a, b in zip(orientation, seen)) < _SAME_DIRECTION for seen in distinct):
            distinct.append(orientation)
    return distinct


def _position_along_normal(placement: _Placement | None) -> float | None:
    if placement is None or placement.orientation is None or placement.position is None:
        return None
    row, column = np.array(placement.orientation[:3]), np.array(placement.orientation[3:])
    normal = np.cross(row, column)
    length = np.linalg.norm(normal)
    if length < 0.5:  # the two directions are not (nearly) perpendicular unit vectors
        return None
    return float(np.dot(placement.position, normal / length))


def _spacing_warnings(positions: list[float]) -> list[str]:
    """Duplicate positions and gaps, in words (positions sorted, in mm)."""
    warnings = []
    steps = np.diff(positions)
    repeated = steps < _SAME_MM
    sharing = int(np.logical_or(np.r_[repeated, False], np.r_[False, repeated]).sum())  # slices at a repeated position
    if sharing:
        warnings.append(f"{sharing} slices share their position with another slice (a repeated or mixed "
                        "acquisition?); they are shown one after the other.")
    spacing = steps[steps >= _SAME_MM]
    if spacing.size:
        usual = float(np.median(spacing))
        gaps = [i for i, step in enumerate(steps) if step > _GAP_FACTOR * usual]
        if gaps:
            where = ", ".join(f"after slice {i + 1} ({steps[i]:.1f} mm)" for i in gaps[:3])
            more = f" and {len(gaps) - 3} more" if len(gaps) > 3 else ""
            warnings.append(f"The series has {len(gaps)} gap{'s' if len(gaps) > 1 else ''} where slices are missing: "
                            f"{where}{more}; slices are {usual:.1f} mm apart elsewhere.")
    return warnings


def cli_scan_study(path: str, as_json: bool) -> int:
    """`python -m medvqa scan PATH [--json]` for a folder, a .zip or `--json`: each series with its
    modality, slice count, positions in display order and warnings; the notes on skipped files."""
    import json
    import sys

    try:
        study = open_study(path)
    except ScanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"series": [series.summary() for series in study.series], "notes": study.notes}))
        return 0
    for series in study.series:
        known = [p for p in series.positions_mm if p is not None]
        span = f", {known[0]:g} to {known[-1]:g} mm" if known else ""
        print(f"{series.describe()}{span}")
        for warning in series.warnings:
            print(f"  warning: {warning}")
        if series.burned_in_slices:
            print(f"  warning: {series.burned_in_slices} of {series.frame_count} slices say text is burned into "
                  "their pixels (Burned In Annotation: YES), which often names the patient; the model reads it.")
    for note in study.notes:
        print(f"note: {note}")
    return 0
