"""``python -m lightning_harness.proxy ...`` is ``lightning-proxy ...`` (how ProxyProcess starts it)."""

from .cli import main

if __name__ == "__main__":
    main()
