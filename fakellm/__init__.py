"""fakellm: a simulated llama-server for development, demos and the test suite.

Not part of the installed product (``pyproject.toml`` packages only the product); run it
from the repository root::

    python -m fakellm --port 5800 [--host 127.0.0.1] [--load-seconds 2]
        [--tokens-per-second 50] [--model-name NAME] [--log-requests] [--record-file PATH]

:mod:`fakellm.app` is the ASGI application (what it answers and the test controls);
:mod:`fakellm.__main__` serves it with daphne.
"""
