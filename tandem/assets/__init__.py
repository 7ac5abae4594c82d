"""vLLM's example assets (``vllm.assets``), for scripts that run with the import changed.

Nothing is downloaded: an asset is the real recording when it is in the assets folder
(``$TANDEM_ASSETS_CACHE``, default ``~/.cache/tandem/assets``), else a stand-in the package
makes itself. See :mod:`tandem.assets.audio`.
"""
