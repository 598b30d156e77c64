"""The start/stop/context-manager shape every local test server shares (the OTLP receivers in
``support.otlp``, the doctor's peers in ``support.peers``): one definition of ``with X() as x``
and of stopping a gRPC or threaded-HTTP server held in ``self._server``."""

from __future__ import annotations

from typing import Any


class Served:
    """``start()`` returns self; ``with`` starts and stops."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GrpcServed(Served):
    """A ``grpc.server`` in ``self._server``."""

    _server: Any = None

    def stop(self) -> None:
        """Stop serving (immediately)."""
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None


class HttpServed(Served):
    """A ``ThreadingHTTPServer`` (serving on a daemon thread) in ``self._server``."""

    _server: Any = None

    def stop(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
