"""The error guard: every failure becomes a `ScanError` whose message is written in this package.

Library messages can quote tag values, so none of them reaches a user or a log: calls into a
library on upload data go through `_guarded`, each public entry point through `_run_public`, and
neither chains the library's exception. While an upload is handled, library loggers and warnings
are silenced (`_quiet_libraries`), and uploads are handled one at a time (`_ONE_AT_A_TIME`).
Network transfers (medvqa/pacs.py) drop the HTTP libraries' log records with `_quiet_logs`, which
takes no lock: a slow archive never holds up anyone's decoding.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import threading
import warnings
from typing import Callable

# The plugins are imported here, not on first use, so that their loggers exist before the first
# upload and get silenced with the rest (Pillow's TIFF plugin logs tag values at debug level).
from PIL import Image, ImageFile, JpegImagePlugin, PngImagePlugin, TiffImagePlugin  # noqa: F401

log = logging.getLogger(__name__)


class ScanError(Exception):
    """Any upload that cannot be shown. The message is for a clinician and never quotes the file."""


# Here rather than in dicom.py because _run_public gives it for a RecursionError, which only a
# DICOM dataset nested too deep provokes.
_DAMAGED_DICOM = "This DICOM file is damaged or incomplete and could not be read."


_DECODING = contextvars.ContextVar("medvqa_imaging_decoding", default=False)
# catch_warnings swaps process-wide state (until Python 3.14); two threads entering and leaving
# it out of order would leave one's filters behind for good. Uploads are therefore handled one
# at a time per process; a frame decodes in milliseconds, so users hardly wait on each other.
_ONE_AT_A_TIME = threading.RLock()
# And the HTTP libraries': their request logs hold the URL, and so a study's identifier (medvqa/pacs.py).
_LIBRARY_LOGGERS = ("pydicom", "PIL", "pylibjpeg", "libjpeg", "openjpeg", "rle", "gdcm", "urllib3", "requests")


class _SilenceWhileDecoding(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _DECODING.get()


_SILENCER = _SilenceWhileDecoding()


@contextlib.contextmanager
def _quiet_logs():
    """Drop the libraries' log records in this thread (a context variable: other threads log as
    usual) while the block runs. A logger filter only sees records logged on that very logger,
    hence one per library logger."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.split(".")[0] in _LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            if _SILENCER not in logger.filters:
                logger.addFilter(_SILENCER)
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


@contextlib.contextmanager
def _quiet_libraries():
    """Drop library log records and warnings while an upload is handled, one upload at a time.
    pydicom logs element values in debug mode and its warnings quote invalid values; Pillow's TIFF
    plugin logs tags."""
    with _quiet_logs(), _ONE_AT_A_TIME, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


_INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _bomb_message(error: BaseException) -> str:
    """What an image declaring more pixels than Pillow will decode is told: how many it declares, which
    Pillow's message gives as a number ("Image size (900000000 pixels) exceeds limit of ...")."""
    declared = re.search(r"\((\d+) pixels\)", str(error))
    size = f"it declares {int(declared.group(1)) / 1e6:,.0f} million pixels" if declared else "it declares too many pixels"
    return f"This image is too large to open safely ({size})."


def _guarded(message: str, function: Callable, *args, **kwargs):
    """Call a library on untrusted data; any failure becomes ScanError(message). The original
    exception is neither chained nor logged in full, as its text may quote the file."""
    try:
        return function(*args, **kwargs)
    except ScanError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        failure = _bomb_message(error)
    except MemoryError:
        failure = "This image is too large to open with the memory available."
    except _INTERRUPTS:
        raise
    except BaseException as error:  # noqa: BLE001 - hostile input can make a library raise anything,
        # including Rust decoders' PanicException, which derives from BaseException
        log.debug("%s raised %s", getattr(function, "__name__", "decoder"), type(error).__name__)
        failure = message
    raise ScanError(failure)  # outside the except block: no chained library exception


def _run_public(function: Callable, *args):
    """Run a public entry point with libraries quiet; every failure leaves as a fresh ScanError,
    with no chained exception or traceback that could hold the upload's values."""
    with _quiet_libraries():
        try:
            return function(*args)
        except ScanError as error:
            failure = str(error)
        except RecursionError:
            failure = _DAMAGED_DICOM
        except MemoryError:
            failure = "This image is too large to open with the memory available."
        except _INTERRUPTS:
            raise
        except BaseException as error:  # noqa: BLE001 - last line of defence on hostile input
            log.debug("unexpected %s while reading an upload", type(error).__name__)
            failure = "This file could not be read as an image."
    log.info("upload not shown: %s", failure)
    raise ScanError(failure)
