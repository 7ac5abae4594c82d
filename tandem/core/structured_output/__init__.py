"""Structured output: ``params`` (what a request asks for, plain data), ``backend``
(xgrammar, imported on first use), ``manager`` (the engine's: compiling off the
step loop, the step's mask). The request's mode is ``strategies/structured.py``."""
