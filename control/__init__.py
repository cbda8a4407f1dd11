"""The control room's records: the scheduler settings edited in the admin (and the
precedence against the config file, applied from ``scheduler.core.settings``), the change
log, the admin-issued API keys and whether keys stay required, with their admin pages.

Below the web layers (``tests/test_layers.py``): ``control`` imports ``scheduler`` and its
core only; ``dashboard`` and ``llamaswap_site`` read and apply what is stored here.
"""
