"""``FlexibleArgumentParser``: vLLM's argument parser (``vllm.utils.FlexibleArgumentParser``,
``vllm.utils.argparse_utils`` in newer vLLM), so vLLM's example scripts parse their flags
with the import changed."""

from __future__ import annotations

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that also takes each long flag with underscores, as vLLM's does:
    ``--max_model_len 448`` is ``--max-model-len 448`` (and ``--max_model_len=448`` too). A
    flag registered with underscores is left as it is; values and positional arguments too."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._dashed(args), namespace)

    def _dashed(self, args: list[str]) -> list[str]:
        out = []
        for i, arg in enumerate(args):
            if arg == "--":  # the rest is positional
                return out + args[i:]
            key, eq, value = arg.partition("=")
            if arg.startswith("--") and "_" in key and key not in self._option_string_actions:
                arg = key.replace("_", "-") + eq + value
            out.append(arg)
        return out
