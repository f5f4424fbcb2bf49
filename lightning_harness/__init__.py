"""Lightning Harness: harnessed agentic RL through a capturing proxy.

The card's folders are installed as subpackages of this one name:
``schemas/`` -> ``lightning_harness.schemas``, ``proxy/`` -> ``lightning_harness.proxy``,
``launcher/`` -> ``lightning_harness.launcher``, ``trainer/`` -> ``lightning_harness.trainer``.
"""

__version__ = "0.1.0"
