"""Speculative decoding: the configuration and the proposers (scheduler side).

Verification (one forward over each sequence's last token and its proposals,
then acceptance) is a request strategy: ``tandem/core/strategies/speculative.py``.
"""
