"""What vLLM's examples import from ``vllm.utils``: ``FlexibleArgumentParser``."""

from tandem.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
