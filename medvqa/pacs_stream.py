"""Reading a DICOMweb archive's answers as they arrive (medvqa/pacs.py's wire format): the parts of a
WADO-RS multipart/related answer, each refused past the upload limits while it arrives, never after
it was read whole; a single unwrapped instance; a QIDO JSON answer decoded as UTF-8 chunk by chunk."""

from __future__ import annotations

from typing import Iterator

from .imaging import ScanLimits

_MAX_PART_HEADER = 16 * 1024  # a part's headers (or the preamble) past this are not DICOMweb


class PacsError(Exception):
    """A query or a fetch failed. The message is for a clinician and never quotes the identifier,
    a URL or the archive's own error text."""


def _instance_too_large(limits: ScanLimits) -> PacsError:
    return PacsError(f"An instance of this series is larger than the {limits.max_bytes / 2**20:,.1f} MB upload "
                     "limit; it was not downloaded further.")


def multipart_bodies(chunks: Iterator[bytes], boundary: bytes, limits: ScanLimits) -> Iterator[bytes]:
    """The bodies of a multipart message's parts as each completes: each under limits.max_bytes, all
    together under limits.max_total_bytes, at most limits.max_files of them."""
    delimiter = b"\r\n--" + boundary
    buffer = bytearray(b"\r\n")  # so that a delimiter at the very start of the body is found too
    total, count, state, search_from = 0, 0, "preamble", 0
    for chunk in chunks:
        total += len(chunk)
        if total > limits.max_total_bytes:
            raise PacsError(f"This series is larger than the {limits.max_total_bytes / 2**20:,.0f} MB allowed for "
                            "one study; it was not downloaded further.")
        buffer += chunk
        while True:
            if state in ("preamble", "body"):
                found = buffer.find(delimiter, search_from)
                if found < 0:
                    search_from = max(0, len(buffer) - len(delimiter))
                    if state == "body" and search_from > limits.max_bytes:
                        raise _instance_too_large(limits)
                    if state == "preamble" and len(buffer) > _MAX_PART_HEADER:
                        raise PacsError("The PACS did not answer as a DICOMweb server does.")
                    break
                if state == "body":
                    if found > limits.max_bytes:
                        raise _instance_too_large(limits)
                    count += 1
                    if count > limits.max_files:
                        raise PacsError(f"This series has more than {limits.max_files:,} instances; at most that "
                                        "many are opened at once.")
                    yield bytes(buffer[:found])
                del buffer[:found + len(delimiter)]
                state, search_from = "delimiter", 0
            if state == "delimiter":  # "--" closes the message; else the next part's headers follow
                if len(buffer) < 2:
                    break
                if buffer[:2] == b"--":
                    return
                state = "headers"
            if state == "headers":
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > _MAX_PART_HEADER:
                        raise PacsError("The PACS did not answer as a DICOMweb server does.")
                    break
                del buffer[:end + 4]
                state = "body"
    if state in ("headers", "body"):
        raise PacsError("The PACS answer was cut short.")


def read_whole(chunks: Iterator[bytes], max_bytes: int) -> bytes:
    data = bytearray()
    for chunk in chunks:
        data += chunk
        if len(data) > max_bytes:
            raise PacsError(f"This instance is larger than the {max_bytes / 2**20:,.1f} MB upload limit; it was "
                            "not downloaded further.")
    return bytes(data)


def multipart_boundary(content_type: str) -> bytes | None:
    media_type, *parameters = [part.strip() for part in content_type.split(";")]
    if media_type.lower() != "multipart/related":
        return None
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "boundary" and value.strip().strip('"'):
            return value.strip().strip('"').encode("latin-1", "replace")
    return None


def utf8_chunks(chunks: Iterator[bytes]) -> Iterator[str]:
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    for chunk in chunks:
        yield decoder.decode(chunk)
    yield decoder.decode(b"", final=True)
