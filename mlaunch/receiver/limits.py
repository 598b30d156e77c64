"""What the receiver's frontends admit and ask of a refused client, apart from the receiver
(:mod:`.core`) because the receiver starts the frontends (:mod:`.frontends`): both read these
and neither imports the other for them."""

from __future__ import annotations

#: The largest request accepted (gRPC max receive size, HTTP body, decompressed HTTP body).
MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: The pause a refused client is asked to wait before sending again.
RETRY_AFTER_S = 1.0
