"""The capture proxy: mitmproxy addons that record every OpenAI model call of a harness.

``lightning-proxy serve`` runs mitmproxy (forward mode for ``HTTP(S)_PROXY`` and reverse mode for
``OPENAI_BASE_URL`` at once) with the addons in :mod:`lightning_harness.proxy.addons`. Code in the
training environment talks to it through :mod:`lightning_harness.proxy.client` only: this package's
``__init__`` imports nothing heavy, so ``client`` and ``locate`` load without mitmproxy.
"""
