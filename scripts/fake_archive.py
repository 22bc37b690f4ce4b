"""A fake DICOMweb archive on loopback that misbehaves on purpose: slow, huge or redirecting answers.

    python scripts/fake_archive.py --delay-s 40                  # answers every request after 40 s
    python scripts/fake_archive.py --study-copies 600000         # a QIDO answer listing one study 600,000 times

Used by tests/test_pacs_limits.py, scripts/bench_pacs.py and scripts/soak_app.py (in process, through
`FakeArchive`). It speaks just enough QIDO-RS and WADO-RS for medvqa/pacs.py: /studies?AccessionNumber=
(or StudyInstanceUID=), /studies/{study}/series and /studies/{study}/series/{series} (multipart/related;
type="application/dicom"); any other path gets 404.
Every request is recorded (monotonic time, path) in `requests`; `sent_bytes` counts the body bytes written.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

STUDY_UID = "1.2.826.0.1.3680043.8.498.1"
SERIES_UID = "1.2.826.0.1.3680043.8.498.2"
BOUNDARY = "medvqa-fake-archive"


@dataclass
class Behaviour:
    """What the archive does; the attributes may change while it serves."""

    delay_s: float = 0.0  # before answering any request
    series_delay_s: float = 0.0  # before answering a series query (one per study found)
    study_copies: int = 1  # entries in the answer to a study query (0: 204 No Content, as some archives say "none")
    distinct_studies: int = 1  # how many different studies those entries name (cycled); a query by
    # StudyInstanceUID is answered with that one
    patients: int = 1  # how many different patient IDs those entries name (cycled)
    instances: list[bytes] = field(default_factory=list)  # the series' DICOM files
    instance_padding: int = 0  # bytes appended to each instance (a series of huge instances)
    redirect_to: str = ""  # answer every request with a redirect to this base URL
    hold: threading.Event | None = None  # when set here, every request waits until it is set (tests)


class FakeArchive:
    """The archive, served from a daemon thread: `with FakeArchive(Behaviour(...)) as archive: archive.url`."""

    def __init__(self, behaviour: Behaviour | None = None, port: int = 0):
        self.behaviour = behaviour or Behaviour()
        self.requests: list[tuple[float, str]] = []
        self.sent_bytes = 0
        self._lock = threading.Lock()
        archive = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection; a body ends when the connection does

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                archive._serve(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/dicom-web"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-archive")

    def __enter__(self) -> FakeArchive:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def request_times(self) -> list[float]:
        with self._lock:
            return [t for t, _ in self.requests]

    # --- serving ------------------------------------------------------------------------------

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        behaviour = self.behaviour
        parts = urlsplit(handler.path)
        with self._lock:
            self.requests.append((time.monotonic(), parts.path))
        if behaviour.redirect_to:
            handler.send_response(302)
            handler.send_header("Location", behaviour.redirect_to.rstrip("/") + parts.path.split("/dicom-web", 1)[-1])
            handler.end_headers()
            return
        time.sleep(behaviour.delay_s)
        if behaviour.hold is not None:
            behaviour.hold.wait(600)
        path = parts.path.split("/dicom-web", 1)[-1].strip("/").split("/")
        try:
            if path == ["studies"]:
                self._studies(handler, parse_qs(parts.query))
            elif len(path) == 3 and path[0] == "studies" and path[2] == "series":
                time.sleep(behaviour.series_delay_s)
                self._json(handler, [{"0020000E": {"vr": "UI", "Value": [SERIES_UID]},
                                      "00080060": {"vr": "CS", "Value": ["CT"]},
                                      "00201209": {"vr": "IS", "Value": [len(behaviour.instances)]}}])
            elif len(path) == 4 and path[0] == "studies" and path[2] == "series":
                self._series(handler)
            else:
                handler.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (or cut the transfer on purpose)

    def _studies(self, handler, query: dict) -> None:
        behaviour = self.behaviour
        if behaviour.study_copies == 0:
            handler.send_response(204)
            handler.end_headers()
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/dicom+json")
        handler.end_headers()
        self._write(handler, b"[")
        batch = []
        for n in range(behaviour.study_copies):  # written as it is made: 600,000 entries never sit in memory
            uid = query.get("StudyInstanceUID", [f"{STUDY_UID}.{n % max(behaviour.distinct_studies, 1)}"])[0]
            patient = f"FAKE-PATIENT-{n % max(behaviour.patients, 1)}"
            batch.append(json.dumps({"0020000D": {"vr": "UI", "Value": [uid]},
                                     "00100020": {"vr": "LO", "Value": [patient]}}))
            if len(batch) == 1000 or n == behaviour.study_copies - 1:
                self._write(handler, (("," if n >= len(batch) else "") + ",".join(batch)).encode())
                batch = []
        self._write(handler, b"]")

    def _json(self, handler, value) -> None:
        body = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/dicom+json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        self._write(handler, body)

    def _series(self, handler) -> None:
        behaviour = self.behaviour
        handler.send_response(200)
        handler.send_header("Content-Type", f'multipart/related; type="application/dicom"; boundary={BOUNDARY}')
        handler.end_headers()
        padding = b"\0" * min(behaviour.instance_padding, 1 << 20)
        for instance in behaviour.instances:
            self._write(handler, f"--{BOUNDARY}\r\nContent-Type: application/dicom\r\n\r\n".encode() + instance)
            left = behaviour.instance_padding
            while left > 0:
                self._write(handler, padding[:left])
                left -= len(padding)
            self._write(handler, b"\r\n")
        self._write(handler, f"--{BOUNDARY}--\r\n".encode())

    def _write(self, handler, data: bytes) -> None:
        handler.wfile.write(data)
        with self._lock:
            self.sent_bytes += len(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--study-copies", type=int, default=1)
    args = parser.parse_args(argv)
    with FakeArchive(Behaviour(delay_s=args.delay_s, study_copies=args.study_copies), port=args.port) as archive:
        print(f"serving {archive.url} (Ctrl-C to stop)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
