"""Keeps the dependencies' import-time noise out of the user's output, whatever PYTHONWARNINGS says.

Importing torch on a host with pynvml warns that pynvml is deprecated, and importing megatron-core's
optimizer without Transformer Engine or Apex warns four times that it falls back to torch's and its own
implementations: ten lines before any answer of ours, on every rank. Both are facts of the installation,
not of the run; pretrain.py states what it runs with in its own log. Only these messages are filtered,
by text, so any other warning still shows.
"""

from __future__ import annotations

import logging
import warnings

_NOISE = (
    (FutureWarning, r"The pynvml package is deprecated"),
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed"),
)
# Logged rather than warned: torch's CUDA build (what the registry gives Python 3.12) on a host without a
# GPU says so when megatron-core imports torch.utils.cpp_extension.
_LOGGED_NOISE = (
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
)


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.text)


def install() -> None:
    for category, message in _NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    for logger, text in _LOGGED_NOISE:
        logging.getLogger(logger).addFilter(_DropMessage(text))
