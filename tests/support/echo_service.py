"""A harness service for tests: listens on ``$LIGHTNING_HARNESS_SERVICE`` and greets each connection
with its pid; prints its folder and any proxy variables it was given (the launcher gives none)."""

import os
import socket

s = socket.socket(socket.AF_UNIX)
s.bind(os.environ["LIGHTNING_HARNESS_SERVICE"])
s.listen()
print("cwd", os.getcwd(), "proxy", [k for k in os.environ if k.lower().endswith("_proxy")], flush=True)
while True:
    c, _ = s.accept()
    try:
        c.sendall(b"hello from " + str(os.getpid()).encode())
    except OSError:  # the readiness probe hangs up at once
        pass
    c.close()
