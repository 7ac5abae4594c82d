"""tandem on Ray (``pip install 'tandem-engine[ray]'``).

``data.TandemPredictor`` / ``data_audio.TandemTranscriber``: offline jobs over Ray
Data, one engine per actor (``ds.map_batches``); ``serve``: the OpenAI server as a
Ray Serve deployment, one engine per replica. Nothing here imports Ray at
``import tandem``: only these modules do, when used.
"""
